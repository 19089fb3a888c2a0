"""The data layer that the agent, the trainer and evaluation share.

- ``conversation``: the conversation format (prompt, tool-call syntax, tool results, chat template use,
  tokenizing a conversation for SFT), with ``chat_template`` (rendering and encoding chats, SFT tokenization)
  and ``tool_result`` (a sandbox result as the model sees it) split out of it and re-exported by it;
- ``tokenizer``: loading a tokenizer, training a tiny one;
- ``tool_parser``: Hermes ``<tool_call>`` parsing;
- ``trajectory``: the ``Trajectory`` record a rollout produces and its tool-error ratios;
- ``batch``: sequences and trajectories -> ``[rows, seq_len]`` token batches (GRPO's ``[groups, 2G]``
  trajectories are flattened row-wise);
- ``problems``, ``synthetic``, ``sft_data``: problem sets, the synthetic integer task, SFT data.
"""
