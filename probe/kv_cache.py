"""Keys and values kept between passes, so generation processes each new token once.

`KVCache` is also transformer-lens's key/value cache for code that runs its own loop (`model(tokens,
past_kv_cache=cache)`, then one token at a time): `init_cache(cfg, device, batch_size)` makes one, and a frozen cache
(`freeze()`) reads its keys and values without keeping the new ones, so several continuations share one prefix."""
from __future__ import annotations

from typing import Optional

import torch


class LayerKV:
    """One layer's keys and values so far, [batch pos kv_head d_head] each, and their positions [batch pos]; or, in a
    linear-attention layer, what it carries instead: its convolution's last inputs and its state."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None  # what ALiBi's distances count from
        self.conv_window: Optional[torch.Tensor] = None  # [batch conv_kernel-1 channel]
        self.state: Optional[torch.Tensor] = None  # [batch v_head d_key_head d_value_head]
        self.index_k: Optional[torch.Tensor] = None  # [batch pos d_index]: a sparse indexer's keys (GLM-5's)
        self.seen = 0  # positions a linear-attention layer has passed (it keeps no keys to count)
        self.frozen = False
        # (keys, values, positions) as this pass's append returned them, frozen or not: what the later layers that
        # reuse this layer's keys and values attend over (shared_kv); layer_caches clears it before each pass
        self.latest: Optional[tuple] = None

    @property
    def length(self) -> int:
        return self.seen if self.k is None else self.k.shape[1]

    def carry(self, conv_window: torch.Tensor, state: torch.Tensor, n_new: int) -> None:
        """A linear-attention layer's convolution window and state after `n_new` more positions, kept unless frozen."""
        if not self.frozen:
            self.conv_window, self.state, self.seen = conv_window, state, self.seen + n_new

    def append_index_keys(self, k: torch.Tensor) -> torch.Tensor:
        """A sparse indexer's keys of every position so far and the new ones, kept unless frozen."""
        if self.index_k is not None:
            k = torch.cat([self.index_k, k], dim=1)
        if not self.frozen:
            self.index_k = k
        return k

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor] = None):
        """(keys, values, their positions) of every position so far and the new ones (at `positions`); kept for the
        next pass unless frozen."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
            if positions is not None and self.positions is not None:
                positions = torch.cat([self.positions, positions], dim=1)
        if not self.frozen:
            self.k, self.v, self.positions = k, v, positions
        self.latest = (k, v, positions)
        return k, v, positions


class KVCache:
    """Every layer's keys and values, plus the attention mask of all positions seen so far."""

    def __init__(self, n_layers: int, batch_size: int = 1, device=None) -> None:
        self.layers = [LayerKV() for _ in range(n_layers)]
        self.attention_mask: Optional[torch.Tensor] = None  # [batch pos]: 1 = real token
        self.frozen = False
        self.batch_size, self.device = batch_size, device  # what the empty mask is made of, before the first pass

    @classmethod
    def init_cache(cls, cfg, device=None, batch_size: int = 1) -> "KVCache":
        """transformer-lens's constructor, `init_cache(model.cfg, model.cfg.device, batch_size)`: an empty cache for a
        model of `cfg` (its device and batch are those of the first tokens it is given)."""
        return cls(cfg.n_layers, batch_size, device)

    # transformer-lens's name: auto_circuit keys its caches by `previous_attention_mask.shape[0]`. TL's per-layer
    # `past_keys` are not offered: probe keeps keys after rotary, TL before it, so they would read other values
    @property
    def previous_attention_mask(self) -> torch.Tensor:
        """The mask of every position so far [batch pos_so_far], empty [batch 0] before the first pass."""
        if self.attention_mask is None:
            return torch.empty((self.batch_size, 0), dtype=torch.int, device=self.device)
        return self.attention_mask

    @property
    def length(self) -> int:
        # the longest layer's: an MLP-only layer (NemotronH's) keeps nothing, so counts nothing
        return max(layer.length for layer in self.layers)

    def extend_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' mask (kept unless frozen); returns the mask of every position, old and new."""
        if self.attention_mask is not None:
            new_mask = torch.cat([self.attention_mask, new_mask], dim=1)
        if not self.frozen:
            self.attention_mask = new_mask
        return new_mask

    append_attention_mask = extend_mask  # transformer-lens's name

    def freeze(self) -> None:
        """Passes read the cache but add nothing to it, as transformer-lens's `freeze()`: one cached prefix serves
        several continuations."""
        self._set_frozen(True)

    def unfreeze(self) -> None:
        self._set_frozen(False)

    def _set_frozen(self, frozen: bool) -> None:
        self.frozen = frozen
        for layer in self.layers:
            layer.frozen = frozen


def one_cache(kv_cache: Optional[KVCache], past_kv_cache: Optional[KVCache]) -> Optional[KVCache]:
    """The cache a forward is given, under probe's keyword or transformer-lens's (`past_kv_cache`), checked."""
    if past_kv_cache is not None:
        if kv_cache is not None and kv_cache is not past_kv_cache:
            raise ValueError("kv_cache= and past_kv_cache= name two caches; they are one keyword (past_kv_cache "
                             "is transformer-lens's name): pass one")
        kv_cache = past_kv_cache
    if kv_cache is not None and not isinstance(kv_cache, KVCache):
        raise TypeError(f"a key/value cache must be probe's KVCache (probe.TransformerLensKeyValueCache.init_cache("
                        f"model.cfg, device, batch_size)), got {type(kv_cache).__name__}")
    return kv_cache


def layer_caches(kv_cache: Optional[KVCache], cfg) -> list[Optional[LayerKV]]:
    """What each block of a pass is handed as `past`: its layer's LayerKV in `kv_cache` (or None without one); a layer
    that reuses an earlier layer's keys and values (cfg.shared_kv) gets that layer's, which then holds this pass's
    keys for it, in a fresh LayerKV when no cache is given."""
    layers = [None] * cfg.n_layers if kv_cache is None else list(kv_cache.layers)
    if cfg.shared_kv is None:
        return layers
    sources = {layer: cfg.layer_kv_source(layer) for layer in range(cfg.n_layers)}
    for source in {s for s in sources.values() if s is not None}:
        if layers[source] is None:
            layers[source] = LayerKV()
        layers[source].latest = None  # a stale pass's keys must not reach this one
    return [layers[layer] if source is None else layers[source] for layer, source in sources.items()]
