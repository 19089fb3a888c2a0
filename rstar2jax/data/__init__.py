"""The data layer that the agent, the trainer and evaluation share.

- ``conversation``: the conversation format (prompt, tool-call syntax, the turns around tool results, the
  format a policy records), with ``chat_template`` (rendering and encoding chats, SFT tokenization) and
  ``tool_result`` (a sandbox result as the model sees it) beside it;
- ``tokenizer``: loading a tokenizer, training a tiny one;
- ``tool_parser``: Hermes ``<tool_call>`` parsing;
- ``trajectory``: the ``Trajectory`` record a rollout produces and its tool-error ratios;
- ``rollout_contract``: what the trainer needs of a rollout, one protocol per capability (a batch call,
  partial rollouts, a stream with weights in flight, statistics, close);
- ``batch``: sequences and trajectories -> ``[rows, seq_len]`` token batches (GRPO's ``[groups, 2G]``
  trajectories are flattened row-wise);
- ``problems``, ``synthetic``, ``sft_data``: problem sets, the synthetic integer task, SFT data.
"""
