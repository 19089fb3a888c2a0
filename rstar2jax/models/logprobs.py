"""Per-token log-prob of a target and policy entropy from final hidden states, without ``[tokens, vocab]``.

With z = h W / tau (hidden state h, output head W ``[D, V]``, temperature tau) and p = softmax(z):

    logp(t) = z_t - lse(z),      entropy = lse(z) - sum_j p_j z_j

Both are computed by a loop over vocabulary chunks of ``chunk`` columns, with a running max m and the sums
s0 = sum_j exp(z_j - m) and s1 = sum_j exp(z_j - m) z_j (so lse = m + log s0, sum_j p_j z_j = s1 / s0). A
``jax.custom_vjp`` gives the gradient chunk by chunk again, from the saved lse and E = sum_j p_j z_j:

    d z_j = g_logp (1[j = t] - p_j) + g_entropy p_j (E - z_j),     d(hW) = d z / tau
    dh = sum_chunks d(hW)_c W_c^T,     dW_c = h^T d(hW)_c   (each chunk of dW written once, in place)

so forward and backward hold ``[tokens, chunk]`` float32 blocks, never ``[tokens, V]``. The last chunk is
shifted left to end at V (no padded copy of W); columns it shares with the chunk before are masked out of the
sums and of dh, and its dW columns are rewritten with identical values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Elements of one [tokens, chunk] float32 block (64 MiB): the chunk width adapts to the number of tokens.
DEFAULT_BLOCK_ELEMENTS = 1 << 24
_MIN_CHUNK = 128


def vocab_chunk(num_tokens: int, vocab_size: int, block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> int:
    """Chunk width: the largest power of two with ``num_tokens * chunk <= block_elements`` (at least 128),
    capped at the vocabulary."""
    chunk = _MIN_CHUNK
    while chunk * 2 * num_tokens <= block_elements and chunk * 2 <= vocab_size:
        chunk *= 2
    return min(chunk, vocab_size)


def einsum_logits(h: jax.Array, w_c: jax.Array, vd: bool) -> jax.Array:
    """float32 logits ``h`` ``[n, D]`` times a head chunk (``[chunk, D]`` if ``vd`` else ``[D, chunk]``) by
    XLA's dot: :func:`token_logprobs_and_entropy`'s default ``product``."""
    return jnp.einsum("nd,vd->nv" if vd else "nd,dv->nv", h, w_c, preferred_element_type=jnp.float32)


def _chunk_logits(h, w, c, chunk, vd: bool, temperature, product):
    """z for vocabulary columns [start, start + chunk) (start clamped to V - chunk) and their ids."""
    vocab = w.shape[0] if vd else w.shape[1]
    start = jnp.minimum(c * chunk, vocab - chunk)
    w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=0 if vd else 1).astype(h.dtype)
    z = product(h, w_c, vd) / temperature
    ids = start + jnp.arange(chunk)
    return z, ids, ids >= c * chunk, w_c, start


def _forward(h, w, targets, temperature, chunk, vd, product):
    n = h.shape[0]
    vocab = w.shape[0] if vd else w.shape[1]

    def body(c, carry):
        m, s0, s1, picked = carry
        z, ids, fresh, _, _ = _chunk_logits(h, w, c, chunk, vd, temperature, product)
        z_max = jnp.max(jnp.where(fresh, z, -jnp.inf), axis=-1)
        m_new = jnp.maximum(m, z_max)
        e = jnp.where(fresh, jnp.exp(z - m_new[:, None]), 0.0)
        scale = jnp.exp(m - m_new)
        s0 = scale * s0 + jnp.sum(e, axis=-1)
        s1 = scale * s1 + jnp.sum(e * z, axis=-1)
        hit = fresh & (ids == targets[:, None])
        picked = picked + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        return m_new, s0, s1, picked

    zeros = jnp.zeros((n,), jnp.float32)
    m, s0, s1, picked = jax.lax.fori_loop(
        0, -(-vocab // chunk), body, (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    )
    lse = m + jnp.log(s0)
    mean_z = s1 / s0
    return picked - lse, lse - mean_z, lse, mean_z


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs_entropy(h, w, targets, temperature, chunk, vd, product):
    logp, entropy, _, _ = _forward(h, w, targets, temperature, chunk, vd, product)
    return logp, entropy


def _fwd(h, w, targets, temperature, chunk, vd, product):
    logp, entropy, lse, mean_z = _forward(h, w, targets, temperature, chunk, vd, product)
    return (logp, entropy), (h, w, targets, lse, mean_z)


def _bwd(temperature, chunk, vd, product, residuals, cotangents):
    h, w, targets, lse, mean_z = residuals
    g_logp, g_entropy = cotangents
    vocab = w.shape[0] if vd else w.shape[1]

    def body(c, carry):
        d_h, d_w = carry
        z, ids, fresh, w_c, start = _chunk_logits(h, w, c, chunk, vd, temperature, product)
        p = jnp.exp(z - lse[:, None])
        d_z = g_logp[:, None] * (jnp.where(ids == targets[:, None], 1.0, 0.0) - p)
        d_z = (d_z + g_entropy[:, None] * p * (mean_z[:, None] - z)) / temperature
        spec_h, spec_w = ("nv,vd->nd", "nv,nd->vd") if vd else ("nv,dv->nd", "nv,nd->dv")
        # Columns shared with the chunk before count once in dh; their dW is rewritten with the same value.
        d_h = d_h + jnp.einsum(
            spec_h, jnp.where(fresh, d_z, 0.0).astype(h.dtype), w_c, preferred_element_type=jnp.float32
        )
        d_w_c = jnp.einsum(spec_w, d_z.astype(h.dtype), h, preferred_element_type=jnp.float32)
        d_w = jax.lax.dynamic_update_slice_in_dim(d_w, d_w_c.astype(d_w.dtype), start, axis=0 if vd else 1)
        return d_h, d_w

    d_h, d_w = jax.lax.fori_loop(
        0,
        -(-vocab // chunk),
        body,
        (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype)),
    )
    return d_h.astype(h.dtype), d_w, None


_logprobs_entropy.defvjp(_fwd, _bwd)


def token_logprobs_and_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    head_layout: str = "dv",
    chunk: int | None = None,
    product=einsum_logits,
) -> tuple[jax.Array, jax.Array]:
    """``log softmax(hidden @ W / temperature)[targets]`` and the entropy of that softmax, float32 ``[...]``.

    Args:
      hidden: ``[..., D]`` final (normed) hidden states.
      head: the output head, ``[D, V]`` (``head_layout="dv"``, an ``lm_head``) or ``[V, D]`` (``"vd"``, a
        tied embedding); each chunk is cast to ``hidden``'s dtype as it is read (no cast copy of the whole
        head), and its gradient comes back in the head's own dtype.
      targets: int ``[...]`` target ids in ``[0, V)``.
      temperature: divides the logits (the sampler's temperature).
      chunk: vocabulary columns per block; default :func:`vocab_chunk` of the token count.
      product: a chunk's float32 logits, as :func:`einsum_logits` computes them (exact numerics' kernels
        pass theirs: ``models.exact_kernels``).

    Values and gradients (w.r.t. ``hidden`` and ``head``) equal the dense computation's; see the module doc.
    """
    if head_layout not in ("dv", "vd"):
        raise ValueError(f"head_layout must be 'dv' or 'vd', got {head_layout!r}")
    vd = head_layout == "vd"
    D = head.shape[1] if vd else head.shape[0]
    vocab = head.shape[0] if vd else head.shape[1]
    if hidden.shape[-1] != D:
        raise ValueError(
            f"hidden's last dim {hidden.shape[-1]} does not match the head's {D} (head {head.shape})"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {targets.shape} must equal hidden's leading dims {hidden.shape[:-1]}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    lead = targets.shape
    h = hidden.reshape(-1, D)
    if chunk is None:
        chunk = vocab_chunk(h.shape[0], vocab)
    chunk = min(chunk, vocab)
    logp, entropy = _logprobs_entropy(
        h, head, targets.reshape(-1).astype(jnp.int32), float(temperature), chunk, vd, product
    )
    return logp.reshape(lead), entropy.reshape(lead)
