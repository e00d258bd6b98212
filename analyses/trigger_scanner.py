"""The streaming state of one top-trigger scan: forward hooks that fold each batch into a running top-k.

Everything per batch stays on the model's device with fixed shapes (`analyses.streaming_topk`): the hook of
each layer finds its candidates, and after the forward one merge folds every layer's into the kept top-k.
The host sends each batch as one packed tensor (`layout_windows`: tokens, next tokens and each window's
document, offset and length), pinned and copied without blocking when the device is a GPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from einops import rearrange

from probe.analyses.streaming_topk import candidates, fold
from probe.analyses.trigger_results import EMPTY_DOC, PAD, empty_state
from probe import HookedDecoder, SparseAutoencoder
from probe.names import act_name

_META = 3  # the packed batch's last columns: each window's document, offset of its first token, length


def layout_windows(windows: list[tuple[int, int, list[int], list[int]]], bos: Optional[int], pad_id: int,
                   n_pos: int, pin: bool = False) -> torch.Tensor:
    """A batch of windows (doc, doc_start, window ids, next ids) as one host tensor [window 2*n_pos+3]:
    the tokens right-padded to n_pos (BOS first when given; right padding needs no attention mask in a
    causal model, and `Scanner.send` gives a bidirectional one its mask), the next ids (-1 past the window),
    then doc, doc_start and the window's length.
    `pin`: in page-locked memory, so the copy to a GPU can overlap its work."""
    offset = int(bos is not None)
    packed = torch.full((len(windows), 2 * n_pos + _META), -1, dtype=torch.long)
    packed[:, :n_pos] = pad_id
    for row, (doc, start, ids, nxt) in enumerate(windows):
        if bos is not None:
            packed[row, 0] = bos
        packed[row, offset:offset + len(ids)] = torch.tensor(ids)
        packed[row, n_pos + offset:n_pos + offset + len(nxt)] = torch.tensor(nxt)
        packed[row, 2 * n_pos:] = torch.tensor([doc, start, len(ids)])
    return packed.pin_memory() if pin else packed


class Scanner:
    """The streaming state of one scan: hooks that fold each batch's activations into the top-k.

    Without `sae` it reads mlp.hook_post of each of `layers`; with one it reads the SAE's features
    at its hook point (`layers` is then that point's one entry, see `sae_layer`)."""

    def __init__(self, model: HookedDecoder, layers: list[int], neurons: torch.Tensor, k: int, context: int,
                 sae: Optional[SparseAutoencoder] = None):
        self.model, self.layers, self.k, self.context, self.sae = model, layers, k, context, sae
        self.neurons = neurons.to(model.device)
        width = model.cfg.d_mlp if sae is None else sae.cfg.d_sae
        self.all_neurons = len(neurons) == width and bool((neurons == torch.arange(len(neurons))).all())
        # the forward runs only as far as the last activation read: through the last chosen layer, or the
        # SAE's block; a point before the blocks needs none of them, one after them (ln_final) the whole model
        if sae is None:
            self.stop_at_layer = max(layers) + 1
        else:
            self.stop_at_layer = layers[0] + 1 if layers[0] >= 0 else stop_outside_blocks(model, sae.cfg.hook_name)
        self.state = empty_state(len(layers), len(neurons), k, context, model.device)  # [layer neuron k ...]
        self.found: list = []  # each layer's candidates in the current forward
        self.batch: dict[str, torch.Tensor] = {}
        self.offset = 1  # tokens before a window's first id: BOS or nothing
        self.neg_inf = torch.full((), -math.inf, device=model.device)  # made there: no copy per batch

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.state = {n: t.to(self.model.device) for n, t in state.items()}

    def pin(self) -> bool:
        """Whether host batches should be pinned: when the copy goes to a GPU."""
        return self.model.device.type == "cuda"

    def set_batch(self, windows: list[tuple[int, int, list[int], list[int]]], bos: Optional[int], pad_id: int,
                  n_pos: int) -> torch.Tensor:
        """Lay out a batch of windows (doc, doc_start, window ids, next ids) and send it to the device:
        the tokens [window n_pos] to run."""
        return self.send(layout_windows(windows, bos, pad_id, n_pos, self.pin()), bos is not None)

    def send(self, packed: torch.Tensor, has_bos: bool) -> torch.Tensor:
        """Copy a `layout_windows` batch to the device (not waiting for it where it is pinned) and derive,
        there, what each row of the flattened batch [(window pos)] needs: the tokens [window pos] to run."""
        packed = packed.to(self.model.device, non_blocking=True)
        n_pos = (packed.shape[1] - _META) // 2
        self.offset = offset = int(has_bos)
        tokens, next_ids = packed[:, :n_pos], packed[:, n_pos:2 * n_pos]
        doc, start, length = packed[:, 2 * n_pos:].unbind(1)
        pos = torch.arange(n_pos, device=packed.device)
        valid = (pos >= offset) & (pos < offset + length[:, None])
        # each position's context is the last `context` tokens of its window up to it, BOS and padding hidden
        shown = tokens.masked_fill(~valid, PAD).to(torch.int32)
        padded = torch.cat([shown.new_full((len(shown), self.context), PAD), shown], dim=1)  # [window pos+context]
        # a bidirectional model's real tokens would attend to the right padding: it is masked (a causal model's
        # real tokens never see it, and its forward runs unmasked, with no read-back of the mask)
        attention_mask = (pos < offset + length[:, None]).long() if self.model.cfg.bidirectional else None
        self.batch = dict(valid=valid.flatten(), next_tokens=next_ids.flatten(), doc=doc, start=start,
                          padded=padded, attention_mask=attention_mask)
        return tokens.contiguous()

    def run(self, tokens: torch.Tensor) -> None:
        """Fold one batch into every layer's top-k, all layers or none: a Ctrl-C during the forward
        leaves the state as it was before the batch, so a resumed scan never counts a window twice."""
        self.state = self.folded(tokens)

    def folded(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state with one more batch folded in, the scanner's own left as it was (the caller commits it)."""
        self.found = [None] * len(self.layers)
        self.model.run_with_hooks(tokens, attention_mask=self.batch.get("attention_mask"), fwd_hooks=self.hooks(),
                                  stop_at_layer=self.stop_at_layer)
        return self._merged()

    def hooks(self):
        if self.sae is not None:
            return [(self.sae.cfg.hook_name, self._sae_hook)]
        return [(act_name("post", l), self._hook(li)) for li, l in enumerate(self.layers)]

    def _hook(self, li: int):
        def fold_layer(post: torch.Tensor, hook) -> None:
            self._fold(li, post)
        return fold_layer

    def _sae_hook(self, activation: torch.Tensor, hook) -> None:
        sae = self.sae
        # only the scanned features: a wide SAE's [batch pos d_sae] would be as large as the activations times d_sae
        ids = self.neurons.to(sae.W_enc.device)
        features = sae.feature_activations(activation.to(sae.W_enc.device), None if self.all_neurons else ids)
        if features.shape != (*activation.shape[:2], len(ids)):
            raise ValueError(f"the SAE's features at {sae.cfg.hook_name!r} have shape {tuple(features.shape)}; "
                             f"top_triggers reads one activation vector per position, [batch pos d_sae]")
        self._fold(0, features.to(self.model.device), selected=True)

    def _fold(self, li: int, post: torch.Tensor, selected: bool = False) -> None:
        """`post` [batch pos unit]: every unit, or with `selected` only the scanned ones, in their order."""
        acts = rearrange(post, "batch pos unit -> (batch pos) unit")
        if not (self.all_neurons or selected):
            acts = acts.index_select(1, self.neurons)
        # [unit (batch pos)], rows not in a window (BOS, padding) at -inf; written unit-major, so that
        # each unit's top-k reads contiguous memory
        masked = torch.empty(acts.shape[::-1], dtype=torch.float32, device=acts.device)
        torch.where(self.batch["valid"], acts.T.float(), self.neg_inf.to(acts.device), out=masked)
        self.found[li] = candidates(masked, self.k)

    def _merged(self) -> dict[str, torch.Tensor]:
        """Every layer's candidates of this batch folded into the kept top-k: a new state, the old one untouched."""
        state, b = self.state, self.batch
        values, rows = (torch.stack(parts) for parts in zip(*self.found))  # [layer unit candidate]
        values, from_kept, index = fold(state["activations"], values, rows, self.k)
        empty = ~from_kept & ~torch.isfinite(values)  # a batch entry at -inf: a slot the corpus has not filled
        new = ~from_kept & ~empty  # empty slots read position -1 of window 0: PAD context, blanks elsewhere
        slot = index.clamp(max=self.k - 1)  # the kept slot, where from_kept
        n_pos = b["padded"].shape[1] - self.context
        window, pos = torch.where(new, index // n_pos, 0), torch.where(new, index % n_pos, -1)

        def pick(name: str, batch_value: torch.Tensor, blank: int) -> torch.Tensor:
            kept = state[name].gather(2, slot)
            return torch.where(from_kept, kept, batch_value).masked_fill(empty, blank)

        # contexts by indexing (views and small index tensors), not by gathering with [layer unit k context] indices
        layer, unit = (torch.arange(n, device=slot.device) for n in slot.shape[:2])
        kept_contexts = state["contexts"][layer[:, None, None], unit[None, :, None], slot]
        contexts = b["padded"].unfold(1, self.context, 1)[window, pos + 1]  # position -1: all PAD
        return dict(
            activations=values,
            docs=pick("docs", b["doc"][window], EMPTY_DOC),
            positions=pick("positions", b["start"][window] + pos - self.offset, EMPTY_DOC),
            contexts=torch.where(from_kept[..., None], kept_contexts, contexts),
            next_tokens=pick("next_tokens", b["next_tokens"][window * n_pos + pos.clamp(min=0)], -1),
        )


def sae_layer(model: HookedDecoder, hook_name: str) -> int:
    """The index of the block holding the hook point, or -1 for a point outside the blocks. Found by
    the point's identity, so a name the hook point is also known by resolves the same."""
    point = model.hook_point(hook_name)
    for layer, block in enumerate(model.blocks):
        if any(point is module for module in block.modules()):
            return layer
    return -1


def stop_outside_blocks(model: HookedDecoder, hook_name: str) -> Optional[int]:
    """stop_at_layer for a hook point outside the blocks: 0 for the embeddings, which come before
    every block, else None (the final norm's points come after all of them)."""
    point = model.hook_point(hook_name)
    before = [getattr(model, name, None) for name in ("hook_embed", "hook_pos_embed")]
    return 0 if any(point is p for p in before) else None
