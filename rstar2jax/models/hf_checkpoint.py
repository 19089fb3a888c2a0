"""Hugging Face checkpoints: load safetensors (single file or sharded index) into the layer-stacked params
tree, optionally straight into a device mesh, and save params as a checkpoint transformers and vLLM load."""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy

from rstar2jax.models.config import ModelConfig, config_from_hf, config_to_hf
from rstar2jax.models.params import is_param_spec, param_specs
from rstar2jax.models.sharding import param_shardings

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
# Bytes per element of every safetensors dtype (for checking a file's header against its size).
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
}  # fmt: skip
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


class HFTensor(NamedTuple):
    """One HF tensor and the (layer slice of the) params leaf it maps to.

    ``in_axes`` says how the HF layout relates to the leaf's: ``None`` for vectors (norms, biases: the leaf
    flattened), ``0`` for a tensor stored as is (the embedding), ``k > 0`` for a linear weight, which HF
    stores ``[out, in]`` with head axes flattened while the leaf puts its ``k`` input axes first (q_proj
    ``[embed, heads, head_dim]``, o_proj ``[heads, head_dim, embed]``).
    """

    name: str
    leaf: tuple[str, ...]
    layer: int | None  # None: not layer-stacked
    leaf_shape: tuple[int, ...]  # of one layer
    in_axes: int | None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.in_axes is None:
            return (math.prod(self.leaf_shape),)
        if self.in_axes == 0:
            return self.leaf_shape
        return (math.prod(self.leaf_shape[self.in_axes :]), math.prod(self.leaf_shape[: self.in_axes]))

    def to_leaf(self, hf: np.ndarray) -> np.ndarray:
        """Leaf-layout view of the HF array (no copy for memory-mapped input)."""
        return (hf.T if self.in_axes else hf).reshape(self.leaf_shape)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        return value.reshape(self.hf_shape[::-1]).T if self.in_axes else value.reshape(self.hf_shape)


_LAYER_TENSORS = (
    ("attn_norm", "input_layernorm.weight", None),
    ("q_proj", "self_attn.q_proj.weight", 1),
    ("k_proj", "self_attn.k_proj.weight", 1),
    ("v_proj", "self_attn.v_proj.weight", 1),
    ("o_proj", "self_attn.o_proj.weight", 2),
    ("q_bias", "self_attn.q_proj.bias", None),
    ("k_bias", "self_attn.k_proj.bias", None),
    ("v_bias", "self_attn.v_proj.bias", None),
    ("q_norm", "self_attn.q_norm.weight", None),
    ("k_norm", "self_attn.k_norm.weight", None),
    ("mlp_norm", "post_attention_layernorm.weight", None),
    ("gate_proj", "mlp.gate_proj.weight", 1),
    ("up_proj", "mlp.up_proj.weight", 1),
    ("down_proj", "mlp.down_proj.weight", 1),
)
_TOP_TENSORS = (
    ("embed", "model.embed_tokens.weight", 0),
    ("final_norm", "model.norm.weight", None),
    ("lm_head", "lm_head.weight", 1),
)
# Present in some checkpoints but carrying nothing the model needs (recomputed RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """Every HF tensor ``config`` needs, by name, grouped by params leaf."""
    specs = param_specs(config)
    tensors = {}
    for leaf, name, in_axes in _TOP_TENSORS:
        if leaf in specs:
            tensors[name] = HFTensor(name, (leaf,), None, specs[leaf].shape, in_axes)
    for leaf, name, in_axes in _LAYER_TENSORS:
        if leaf in specs["layers"]:
            for layer in range(config.num_layers):
                full_name = f"model.layers.{layer}.{name}"
                leaf_shape = specs["layers"][leaf].shape[1:]
                tensors[full_name] = HFTensor(full_name, ("layers", leaf), layer, leaf_shape, in_axes)
    return tensors


def _read_safetensors_header(file_path: str) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, header length) of one file, checked against its size:
    raises ValueError saying what is wrong (a truncated or damaged file, an unknown dtype, ...)."""
    size = os.path.getsize(file_path)
    with open(file_path, "rb") as f:
        if size < 8:
            raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise ValueError(f"header of {header_len} bytes does not fit in its {size} bytes (truncated?)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a {type(header).__name__}, not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for tensor, info in header.items():
        try:
            itemsize = _SAFETENSORS_ITEMSIZE[info["dtype"]]
            begin, end = (int(v) for v in info["data_offsets"])
            count = math.prod(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"tensor {tensor!r}: bad header entry {info!r} ({error!r})") from None
        if not 0 <= begin <= end <= data_size:
            raise ValueError(
                f"tensor {tensor!r}: bytes {begin}..{end} lie outside the {data_size} data bytes (truncated?)"
            )
        if end - begin != count * itemsize:
            raise ValueError(
                f"tensor {tensor!r}: {end - begin} bytes for shape {info['shape']} of {info['dtype']}"
            )
    return header, header_len


class _SafetensorsDir:
    """Memory-mapped, zero-copy views of every tensor in a checkpoint directory (single file or sharded)."""

    def __init__(self, path: str, files: list[str] | None = None):
        """``files``: these files of ``path`` instead of the checkpoint's own (e.g. a PEFT adapter's)."""
        index_path, single_path = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
        if files is None and os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif files is None and os.path.exists(single_path):
            files = [SINGLE_FILE]
        elif files is None:
            raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.headers: dict[str, tuple[str, dict, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            file_path = os.path.join(path, name)
            try:
                header, header_len = _read_safetensors_header(file_path)
            except ValueError as error:
                raise ValueError(f"{file_path}: not a valid safetensors file: {error}") from None
            for tensor, info in header.items():
                self.headers[tensor] = (file_path, info, 8 + header_len)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[name][1]["shape"])

    def dtype(self, name: str) -> str:
        return self.headers[name][1]["dtype"]

    def array(self, name: str) -> np.ndarray:
        file_path, info, data_start = self.headers[name]
        if file_path not in self._maps:
            self._maps[file_path] = np.memmap(file_path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[file_path][data_start + begin : data_start + end]
        return raw.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    compute_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    **config_overrides,
) -> tuple[ModelConfig, dict]:
    """Read a HF checkpoint directory (``config.json`` + safetensors) into ``(config, params)``.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``.
      dtype: parameter dtype (float32 master weights by default); becomes ``config.param_dtype``.
      compute_dtype: ``config.compute_dtype``; default ``dtype``.
      mesh: if given, each tensor is placed straight into its :func:`param_shardings` placement: every device
        reads only its own slice from the memory-mapped files.
      **config_overrides: other ModelConfig fields (``scan_layers``, ``remat_policy``, ...).

    Raises:
      ValueError naming every missing, unexpected or wrongly shaped tensor (and unsupported config fields).
    """
    path = os.fspath(path)
    dtype = jnp.dtype(dtype)
    config = config_from_hf(
        path, param_dtype=dtype.name, compute_dtype=jnp.dtype(compute_dtype or dtype).name, **config_overrides
    )
    checkpoint = _SafetensorsDir(path)
    expected = hf_tensors(config)
    if problems := _mismatches(checkpoint, expected, config):
        raise ValueError(
            f"checkpoint {path} does not match its config ({config.model_type}): " + "; ".join(problems)
        )
    specs = param_specs(config)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, specs, is_leaf=is_param_spec)
    else:
        shardings = param_shardings(config, mesh)
    by_leaf: dict[tuple[str, ...], list[HFTensor]] = {}
    for tensor in expected.values():
        by_leaf.setdefault(tensor.leaf, []).append(tensor)  # per-layer tensors come in layer order
    flat_specs, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_param_spec)
    leaves = [
        _load_leaf(checkpoint, by_leaf[tuple(k.key for k in key_path)], spec.shape, sharding, dtype)
        for (key_path, spec), sharding in zip(flat_specs, jax.tree.leaves(shardings), strict=True)
    ]
    return config, jax.tree.unflatten(treedef, leaves)


def _mismatches(checkpoint: _SafetensorsDir, expected: dict[str, HFTensor], config: ModelConfig) -> list[str]:
    """Every way the checkpoint's tensors differ from the config's: missing, unexpected, wrongly shaped,
    of a dtype safetensors here cannot read."""
    present = {name for name in checkpoint.headers if not name.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the copy; transformers ignores it too
    problems = []
    if missing := sorted(set(expected) - present):
        problems.append(f"missing tensors: {missing}")
    if unexpected := sorted(present - set(expected)):
        problems.append(f"unexpected tensors: {unexpected}")
    problems += [
        f"tensor {name} has shape {checkpoint.shape(name)}, expected {tensor.hf_shape}"
        for name, tensor in expected.items()
        if name in present and checkpoint.shape(name) != tensor.hf_shape
    ]
    problems += [
        f"tensor {name} has dtype {checkpoint.dtype(name)}, not one of {sorted(SAFETENSORS_DTYPES)}"
        for name in sorted(present & set(expected))
        if checkpoint.dtype(name) not in SAFETENSORS_DTYPES
    ]
    return problems


def _load_leaf(checkpoint: _SafetensorsDir, sources: list[HFTensor], shape, sharding, dtype) -> jax.Array:
    """One parameter leaf from its HF tensors (one, or one per layer stacked), each device reading only its
    own slice."""

    def read_slice(tensor: HFTensor, index) -> np.ndarray:
        # ``to_leaf`` is a view of the memory map: only the bytes of this device's slice are read.
        return np.asarray(tensor.to_leaf(checkpoint.array(tensor.name))[index], dtype=dtype)

    def read(index):
        if sources[0].layer is None:
            return read_slice(sources[0], index)
        return np.stack([read_slice(tensor, index[1:]) for tensor in sources[index[0]]])

    return jax.make_array_from_callback(shape, sharding, read)


def _check_params(params: dict, config: ModelConfig) -> None:
    """``params`` has the config's tree and every leaf its shape (a ValueError naming the first that is
    not)."""
    specs = param_specs(config)
    expected_structure = jax.tree.structure(specs, is_leaf=is_param_spec)
    if jax.tree.structure(params) != expected_structure:
        raise ValueError(
            f"params tree {jax.tree.structure(params)} does not match config tree {expected_structure}"
        )
    for (key_path, spec), leaf in zip(
        jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_param_spec)[0],
        jax.tree.leaves(params),
        strict=True,
    ):
        if tuple(leaf.shape) != spec.shape:
            raise ValueError(
                f"param {jax.tree_util.keystr(key_path)} has shape {tuple(leaf.shape)}, expected {spec.shape}"
            )


def _plan_files(
    expected: dict[str, HFTensor], itemsize: int, max_shard_bytes: int
) -> dict[str, list[HFTensor]]:
    """The safetensors files to write, by name, each with its tensors in order: one file
    (``model.safetensors``), or shards of at most ``max_shard_bytes`` (a larger tensor alone) named
    ``model-0000i-of-0000n.safetensors``; planned from shapes first so every name knows the count."""
    files: list[list[HFTensor]] = [[]]
    file_bytes = 0
    for tensor in expected.values():
        size = math.prod(tensor.hf_shape) * itemsize
        if files[-1] and file_bytes + size > max_shard_bytes:
            files.append([])
            file_bytes = 0
        files[-1].append(tensor)
        file_bytes += size
    if len(files) == 1:
        return {SINGLE_FILE: files[0]}
    return {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors": tensors for i, tensors in enumerate(files)}


def _write_files(params: dict, files: dict[str, list[HFTensor]], path: str, store_dtype) -> None:
    """Writes each planned file, gathering every parameter leaf to the host once (tensors come grouped by
    leaf)."""
    host_leaf: tuple[tuple[str, ...], np.ndarray] | None = None
    for file_name, tensors in files.items():
        arrays = {}
        for tensor in tensors:
            if host_leaf is None or host_leaf[0] != tensor.leaf:
                value = params[tensor.leaf[0]] if len(tensor.leaf) == 1 else params["layers"][tensor.leaf[1]]
                host_leaf = (tensor.leaf, np.asarray(jax.device_get(value)))
            value = host_leaf[1] if tensor.layer is None else host_leaf[1][tensor.layer]
            arrays[tensor.name] = np.ascontiguousarray(tensor.to_hf(value).astype(store_dtype))
        safetensors.numpy.save_file(arrays, os.path.join(path, file_name), metadata={"format": "pt"})


def save_pretrained(
    params: dict,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    dtype=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer=None,
    prompt=None,
) -> None:
    """Write ``params`` as a HF checkpoint: ``config.json`` plus safetensors (split into
    ``model-0000i-of-0000n.safetensors`` with an index once larger than ``max_shard_bytes``), loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM.

    ``dtype``: stored weight dtype, default the params' own. Sharded params are gathered one leaf at a time.
    ``tokenizer``: a Hugging Face tokenizer to save beside the weights (its files and chat template), so the
    folder alone is a policy that ``config.model.path`` (and its tokenizer) can start from.
    ``prompt``: the conversation format the policy was trained in (a ``data.conversation.PromptConfig``:
    anything with ``save_pretrained(folder)``), recorded as ``rstar2jax_prompt.json`` so that serving,
    evaluation, chat and further training prompt the policy as it was trained. Without it the folder is a
    plain HF model, prompted by its chat template alone.
    """
    path = os.fspath(path)
    _check_params(params, config)
    store_dtype = jnp.dtype(dtype if dtype is not None else jax.tree.leaves(params)[0].dtype)
    if store_dtype not in SAFETENSORS_DTYPES.values():
        raise ValueError(f"cannot store dtype {store_dtype}; supported: {list(SAFETENSORS_DTYPES.values())}")
    expected = hf_tensors(config)
    files = _plan_files(expected, store_dtype.itemsize, max_shard_bytes)
    os.makedirs(path, exist_ok=True)
    _write_files(params, files, path, store_dtype)
    if len(files) > 1:
        total = sum(math.prod(tensor.hf_shape) * store_dtype.itemsize for tensor in expected.values())
        weight_map = {tensor.name: file_name for file_name, tensors in files.items() for tensor in tensors}
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_to_hf(config, dtype=store_dtype.name), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if prompt is not None:
        prompt.save_pretrained(path)
