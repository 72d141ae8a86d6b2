"""Hugging Face transformers models generate over kvcupy's quantized paged cache.

    from kvcupy.integrations.transformers import PagedCache   # registers attn_implementation="kvcupy"
    model.set_attn_implementation("kvcupy")                    # or from_pretrained(..., attn_implementation="kvcupy")
    out = model.generate(**inputs, past_key_values=PagedCache(model, "int4_per_token_head"))

`PagedCache` is a transformers `Cache` over a `kvcupy.PagedKVCache`: one
kvcupy sequence per batch row, every layer's keys and values written once,
quantized, by `reshape_and_cache`; nothing dequantized is ever kept. Its
`update` hands the new keys and values on untouched, and the "kvcupy"
attention function (registered in transformers' AttentionInterface) writes
them to their slots and runs `paged_attention` over the pages: prefill,
chunked prefill and decode, GQA, sliding windows, softcap and sinks.

How transformers' batches map onto sequences. generate pads a batch (left
padding) and passes a 2D attention mask over every position so far; the
"kvcupy" mask function (AttentionMaskInterface) hands that mask to the
attention function as it is. Each row's real tokens are written to its
sequence back to back, pads are skipped (slot -1) and their outputs are zero.
kvcupy attends causally over a sequence's tokens, which is what the mask says
exactly when a row's real tokens are one contiguous run: left padding, right
padding, or both. Anything else (a hole in a row, a 4D or custom mask,
chunked or bidirectional attention) is refused with a ValueError or
NotImplementedError rather than computed differently.

Beam search, `num_return_sequences` and contrastive search reorder, repeat
and select rows: those fork kvcupy sequences (pages shared, copy-on-write).
A paged sequence only grows, so `crop` (assisted generation, DoLa) is refused.
Gradients are not supported: kvcupy's attention has no backward.

Continuous batching (`generate_batch`) is not supported: transformers builds
its own `PagedAttentionCache` (dense model-dtype pages in one flat tensor,
its own block tables) inside the batch processor, with no hook for another
cache, and `switch_to_cb_friendly_attn` accepts only "paged|eager", "sdpa"
or a flash implementation.

This module imports without torch or transformers (kvcupy's modules import
alone); `PagedCache` then raises ImportError naming the `transformers` extra.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np

from ..batch import SlotMapping, plan_slots
from ..cache import CacheFullError, PagedKVCache
from ..rotation import RotationPlan

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as error:   # the `transformers` extra is not installed
    _MISSING: ImportError | None = error
    Cache = CacheLayerMixin = object
else:
    _MISSING = None

ATTN_IMPLEMENTATION = "kvcupy"

# Layer types whose attention is causal over one run of tokens (transformers'
# cache_utils names); everything else (chunked, linear, shared KV) is refused.
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

_TORCH_DTYPE_NAMES = ("float16", "bfloat16", "float32")


def _mask_window(mask_function) -> int | None:
    """The sliding window of one of transformers' causal mask functions (None: plain
    causal); NotImplementedError for any other pattern (packed sequences, blockwise
    or bidirectional overlays, chunked attention)."""
    if mask_function is causal_mask_function:
        return None
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
        if (len(parts) == 2 and parts[1] is causal_mask_function
                and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"):
            return int(inspect.getclosurevars(parts[0]).nonlocals["sliding_window"])
    name = getattr(mask_function, "__qualname__", repr(mask_function))
    raise NotImplementedError(
        f"attn_implementation='kvcupy' attends causally (optionally within a sliding window) over "
        f"each row's contiguous tokens; this model asks for the mask pattern {name}, which it cannot honour")


def kvcupy_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function=None, attention_mask=None, **kwargs):
    """AttentionMaskInterface entry: checks the pattern, returns the 2D padding mask
    [batch, positions so far] as generate gave it (None: no padding)."""
    _mask_window(causal_mask_function if mask_function is None else mask_function)
    return attention_mask


@dataclass(frozen=True)
class _Step:
    """One forward pass's tokens as kvcupy sequences, shared by every layer.

    The new tokens are the B x T grid of the call, flattened row by row; the real
    ones of each active row are one contiguous run, in row order."""

    batch_size: int
    num_tokens: int                        # T: new positions per row, pads included
    slot_mapping: SlotMapping              # [B*T]: each token's slot, -1 for pads
    seq_ids: list                          # the rows with new real tokens, in row order
    query_lens: tuple                      # their numbers of new real tokens
    real_rows: "torch.Tensor | None"       # [sum(query_lens)] flat indices; None: no pads


def _row_runs(new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of new [B, T] (bool): first real index, count, and whether the real
    entries are one contiguous run."""
    count = new.sum(axis=1)
    first = np.argmax(new, axis=1)
    last = new.shape[1] - 1 - np.argmax(new[:, ::-1], axis=1)
    contiguous = (count == 0) | (last - first + 1 == count)
    return first, count, contiguous


class _PagedLayer(CacheLayerMixin):
    """transformers' view of one layer: how many positions (pads included) it has seen.
    The tokens themselves live in the PagedCache's kvcupy pages."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.length = 0
        self.pending = None   # (key, value) of update(), until the attention function writes them

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("PagedCache.update writes every layer")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.pending = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a kvcupy paged sequence only grows: PagedCache cannot crop tokens "
                                  "(assisted generation, DoLa and other rollbacks need that)")


class PagedCache(Cache):
    """A transformers Cache whose keys and values live quantized in a kvcupy.PagedKVCache.

    model: the transformers model it serves (its text config gives layers, KV heads
    and head size; its first parameter gives device and dtype). kv_dtype: one of
    kvcupy.KV_DTYPES ("auto" stores the model dtype). max_tokens: how many tokens
    all rows together may hold (pads are never stored; each row's last page may be
    partly filled); past it a step raises CacheFullError. rotation: a
    kvcupy.RotationPlan, None for the KV dtype's default. The model must run with
    attn_implementation="kvcupy".
    """

    def __init__(self, model, kv_dtype: str = "int4_per_token_head", *, max_tokens: int = 4096,
                 block_size: int = 16, rotation: RotationPlan | None = None):
        if _MISSING is not None:
            raise ImportError("kvcupy.integrations.transformers needs torch and transformers: "
                              "pip install 'kvcupy[transformers]'") from _MISSING
        config = model.config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        refused = sorted({t for t in layer_types if t not in _SUPPORTED_LAYER_TYPES})
        if refused:
            raise NotImplementedError(f"{type(model).__name__} has layers of type {refused}; PagedCache "
                                      f"serves {list(_SUPPORTED_LAYER_TYPES)} layers only")
        parameter = next(model.parameters())
        dtype = str(parameter.dtype).removeprefix("torch.")
        if dtype not in _TORCH_DTYPE_NAMES:
            raise TypeError(f"the model computes in {parameter.dtype}; kvcupy takes {list(_TORCH_DTYPE_NAMES)}")
        device = parameter.device
        if kv_dtype == "auto" and dtype == "float32" and device.type != "cpu":
            # The GPU attention kernels read 16-bit or quantized rows (tensor-core operands).
            raise ValueError(f"kv_dtype='auto' stores the model's float32 rows, which kvcupy attends over on the "
                             f"CPU only; on {device.type}, run the model in float16 or bfloat16 or take a "
                             "quantized kv_dtype")
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.manager = PagedKVCache(
            num_layers=len(layer_types), num_blocks=max(1, math.ceil(max_tokens / block_size)),
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, kv_dtype=kv_dtype,
            device="cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}",
            rotation=rotation, dtype=dtype)
        self.kv_dtype = kv_dtype
        self._config = config
        self._num_slots = self.manager.num_blocks * self.manager.block_size
        super().__init__(layers=[_PagedLayer(kwargs.get("sliding_window")) for kwargs in layer_kwargs])
        self._clear()

    def _clear(self) -> None:
        self._rows: list | None = None       # kvcupy sequence id of each batch row
        self._first = np.zeros(0, np.int64)  # padded position of each row's first real token
        self._count = np.zeros(0, np.int64)  # real tokens each row holds
        self._planned = 0                    # positions (pads included) the pages are reserved for
        self._step: _Step | None = None

    def __repr__(self) -> str:
        rows = "none yet" if self._rows is None else len(self._rows)
        return f"PagedCache(rows={rows}, positions={self._planned}, manager={self.manager!r})"

    @property
    def bytes_per_token(self) -> int:
        """What one token costs in the cache, all layers, K and V, scales included."""
        return self.manager.stats().bytes_per_token

    # --- transformers' Cache protocol -----------------------------------------

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Keep layer `layer_idx`'s new keys/values [B, Hk, T, d] for its attention call,
        which writes them quantized; returns them as they are, tagged with this cache."""
        implementation = getattr(self._config, "_attn_implementation", None)
        if implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"PagedCache is read by attn_implementation='kvcupy', but the model runs "
                             f"{implementation!r} (which would see only the new tokens): call "
                             "model.set_attn_implementation('kvcupy') first")
        layer = self.layers[layer_idx]
        if layer.pending is not None:
            raise RuntimeError(f"layer {layer_idx}'s previous keys were never attended: the attention "
                               "function of this model does not go through attn_implementation='kvcupy'")
        layer.lazy_initialization(key_states, value_states)
        layer.pending = (key_states, value_states)
        layer.length += key_states.shape[2]
        key_states._kvcupy_layer = (self, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def reset(self) -> None:
        for seq_id in self._rows or ():
            self.manager.free(seq_id)
        for layer in self.layers:
            layer.reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        self.layers[0].crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._rows is not None:
            self._select_rows(np.repeat(np.arange(len(self._rows)), repeats))

    def batch_select_indices(self, indices) -> None:
        self._select_rows(indices)

    def _select_rows(self, indices) -> None:
        """Row i becomes old row indices[i]: a fork, so rows picked twice share pages."""
        if self._rows is None:
            return
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu()
        picked = np.asarray(indices, np.int64).reshape(-1)
        rows = [self.manager.fork(self._rows[i]) for i in picked]
        for seq_id in self._rows:
            self.manager.free(seq_id)
        self._rows = rows
        self._first, self._count = self._first[picked], self._count[picked]
        self._step = None

    # --- the attention function's side ----------------------------------------

    def attend(self, layer_idx: int, query, attention_mask, *, scaling: float | None,
               sliding_window: int | None, softcap: float | None, sinks):
        """Write layer `layer_idx`'s pending keys/values and attend query [B, Hq, T, d]
        over the pages; returns [B, T, Hq, d] (pads' rows zero)."""
        layer = self.layers[layer_idx]
        if layer.pending is None:
            raise RuntimeError(f"layer {layer_idx} has no new keys: PagedCache.update runs before each attention call")
        key, value = layer.pending
        layer.pending = None
        if sliding_window != layer.sliding_window:
            raise ValueError(f"layer {layer_idx} attends with sliding_window={sliding_window}, but the "
                             f"config's layer type gives its mask a window of {layer.sliding_window}")
        batch, num_heads, num_tokens, head_size = query.shape
        step = self._step_for(layer, batch, num_tokens, attention_mask, query.device)

        def rows(x):   # [B, H, T, d] -> [B*T, H, d], row by row
            return x.transpose(1, 2).reshape(batch * num_tokens, x.shape[1], head_size)

        self.manager.write(layer_idx, rows(key), rows(value), step.slot_mapping)
        queries = rows(query)
        if not step.seq_ids:
            return torch.zeros_like(queries).view(batch, num_tokens, num_heads, head_size)
        if step.real_rows is not None:
            queries = queries.index_select(0, step.real_rows)
        out = self.manager.attention(
            layer_idx, queries, step.seq_ids, query_lens=step.query_lens, softmax_scale=scaling,
            sliding_window=sliding_window, softcap=softcap or 0.0,
            sinks=None if sinks is None else sinks.detach())
        if step.real_rows is not None:
            out = torch.zeros((batch * num_tokens, num_heads, head_size), dtype=out.dtype,
                              device=out.device).index_copy_(0, step.real_rows, out)
        return out.view(batch, num_tokens, num_heads, head_size)

    def _step_for(self, layer: _PagedLayer, batch: int, num_tokens: int, attention_mask, device) -> _Step:
        """The current step's plan: made by the step's first layer, reused by the rest."""
        if layer.length == self._planned and self._step is not None:
            if (self._step.batch_size, self._step.num_tokens) != (batch, num_tokens):
                raise ValueError(f"this layer attends {batch} x {num_tokens} tokens; the step's first layer "
                                 f"attended {self._step.batch_size} x {self._step.num_tokens}")
            return self._step
        if layer.length != self._planned + num_tokens:
            raise RuntimeError(f"a layer has seen {layer.length - num_tokens} positions, the cache "
                               f"{self._planned}: a forward pass stopped part-way; reset() the cache")
        self._step = self._plan(batch, num_tokens, attention_mask, device)
        self._planned = layer.length
        return self._step

    def _plan(self, batch: int, num_tokens: int, attention_mask, device) -> _Step:
        past = self._planned
        if self._rows is None:
            self._rows = [self.manager.add_sequence() for _ in range(batch)]
            self._first = np.zeros(batch, np.int64)
            self._count = np.zeros(batch, np.int64)
        if batch != len(self._rows):
            raise ValueError(f"the batch has {batch} rows; this cache holds {len(self._rows)} "
                             "(start a new PagedCache, or reset() this one, for another batch)")
        new = self._new_tokens(attention_mask, batch, num_tokens, past)
        start, count, contiguous = _row_runs(new)
        held = self._count > 0
        joined = ~held | (count == 0) | (past + start == self._first + self._count)
        bad = np.flatnonzero(~(contiguous & joined))
        if bad.size:
            raise ValueError(f"attention_mask row {int(bad[0])}: its real tokens are not one contiguous "
                             "run (left or right padding); kvcupy keeps each row as one causal sequence "
                             "and cannot skip positions inside it")
        self._first = np.where(held, self._first, past + start)
        self._count = self._count + count
        active = np.flatnonzero(count)
        seq_ids = [self._rows[b] for b in active]
        try:
            slots = self.manager.reserve(seq_ids, count[active].tolist())
        except CacheFullError as error:
            raise CacheFullError(f"{error} (PagedCache(max_tokens=...) sets the size)") from None
        flat = np.concatenate([b * num_tokens + np.arange(start[b], start[b] + count[b]) for b in active]
                              or [np.zeros(0, np.int64)])
        padded = np.full(batch * num_tokens, -1, np.int64)
        padded[flat] = slots
        real_rows = None if flat.size == batch * num_tokens else torch.as_tensor(flat, device=device)
        return _Step(batch, num_tokens, plan_slots(padded, num_slots=self._num_slots), seq_ids,
                     tuple(int(n) for n in count[active]), real_rows)

    def _new_tokens(self, attention_mask, batch: int, num_tokens: int, past: int) -> np.ndarray:
        """[B, T] bool: which of the step's tokens are real; checks the mask's history
        against what the rows hold."""
        if attention_mask is None:
            return np.ones((batch, num_tokens), bool)
        if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, past + num_tokens):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; attn_implementation="
                             f"'kvcupy' takes generate's 2D padding mask ({batch}, {past + num_tokens}) "
                             "over every position so far")
        mask = attention_mask.to(torch.int32)
        host = torch.cat([mask[:, past:], mask[:, :past].sum(dim=1, keepdim=True)], dim=1).cpu().numpy()
        if not np.array_equal(host[:, -1], self._count):
            row = int(np.flatnonzero(host[:, -1] != self._count)[0])
            raise ValueError(f"attention_mask row {row} marks {int(host[row, -1])} earlier real tokens; "
                             f"the cache holds {int(self._count[row])} for it")
        return host[:, :num_tokens].astype(bool)


def kvcupy_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None, s_aux=None, **kwargs):
    """AttentionInterface entry "kvcupy": attention over the PagedCache that returned `key`.
    Returns ([B, T, Hq, d], None), as transformers' attention functions do."""
    handle = getattr(key, "_kvcupy_layer", None)
    if handle is None:
        raise ValueError("attn_implementation='kvcupy' attends over a kvcupy PagedCache: pass "
                         "past_key_values=PagedCache(model, kv_dtype) (use_cache=True)")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError("attn_implementation='kvcupy' is causal attention; this layer is not causal")
    if module.training and dropout:
        raise NotImplementedError("attn_implementation='kvcupy' has no attention dropout (the model is training)")
    if torch.is_grad_enabled() and query.requires_grad:
        raise NotImplementedError("kvcupy's attention has no backward: run generation under torch.no_grad()")
    cache, layer_idx = handle
    return cache.attend(layer_idx, query, attention_mask, scaling=scaling, sliding_window=sliding_window,
                        softcap=softcap, sinks=s_aux), None


if _MISSING is None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvcupy_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvcupy_mask)
