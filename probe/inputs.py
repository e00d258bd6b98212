"""What a HookedDecoder's forward pass is given, checked before any work: token ids, an attention mask, a residual
stream; and what a mask implies, each new token's position and the keys each query may attend to."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from probe.config_chunked import Chunk
from probe.tokenizer import check_padding_side
from probe.tokens import is_text

ModelInput = Union[str, Sequence[str], torch.Tensor]


class InputChecks:
    """The checks of a forward's inputs, a mixin of HookedDecoder (it reads self.cfg, self.device, the tokenizer)."""

    # transformer-lens 3 embeds with `W_E[tokens]`, which reads a negative id from the end of the vocabulary, as
    # Python indexes a list; probe.HookedTransformer reads them so too (ARENA's cumulative-sum problem embeds the
    # numbers -5 .. 5 as themselves, and its checkpoint was trained on that), HookedDecoder refuses them
    negative_ids_from_the_end: bool = False

    def tokens_and_mask(self, input: ModelInput, attention_mask: Optional[torch.Tensor],
                         padding_side: Optional[str] = None, prepend_bos: Optional[bool] = None,
                         infer_padding: bool = True, cached: bool = False):
        """Token ids on the model's device and their [batch pos] long mask (None: nothing padded). Token ids given
        without a mask have their left padding read off the pad id, as transformer-lens does (`padding_of`), unless
        `infer_padding=False` (generate's placeholders). `cached`: a run into a key/value cache, whose keys later
        tokens read, so padding on either side is masked, as transformer-lens masks a run with a cache."""
        if is_text(input):
            if attention_mask is not None:
                raise ValueError("attention_mask is built for you when the input is text; pass token ids to give one")
            padding_side = padding_side or self._require_tokenizer().padding_side
            # never truncated here: text longer than n_ctx is refused (validate_tokens) rather than cut silently
            tokens, attention_mask = self.to_tokens(input, prepend_bos=prepend_bos, return_attention_mask=True,
                                                    padding_side=padding_side, truncate=False)
            if bool(attention_mask.all()) or (padding_side == "right" and not self.cfg.bidirectional and not cached):
                # causal attention alone is exact for every real token when the padding comes after them, and it
                # gives the padded positions transformer-lens's values (they attend like real tokens); a
                # bidirectional model's real tokens would read the padding after them, so it keeps the mask
                attention_mask = None
        elif isinstance(input, torch.Tensor):
            tokens = input
        elif isinstance(input, (list, tuple)) and not input:
            raise ValueError("the input is an empty list: give a string, a non-empty list of strings or token ids")
        else:
            raise TypeError(f"input must be a string, a list of strings or a tensor of token ids, got {type(input).__name__}")
        tokens = self.validate_tokens(tokens)
        if attention_mask is None and infer_padding and isinstance(input, torch.Tensor):
            return tokens, self.padding_of(tokens, padding_side, prepend_bos, cached)
        return tokens, check_mask(attention_mask, tuple(tokens.shape), "the tokens'", tokens.device)

    def padding_of(self, tokens: torch.Tensor, padding_side: Optional[str] = None,
                   prepend_bos: Optional[bool] = None, cached: bool = False) -> Optional[torch.Tensor]:
        """transformer-lens 3's mask for token ids [batch pos] given without one (HookedTransformer.forward with
        utils.get_attention_mask): when the padding side, this call's or else the tokenizer's (`default_padding_side=`
        sets it), is left, each row's leading run of pad ids is padding, except its last one when BOS is prepended
        and is the pad id (it is that row's BOS). Right padding is not read: the pads come after every real token,
        which causal attention never lets see them, unless the run is `cached` (into a key/value cache, whose keys
        later tokens read): then each row's trailing run is padding too, as TL masks every run with a cache (a
        continuation's pad ids as well). None when nothing is padding."""
        tokenizer = self.tokenizer
        if padding_side is not None:
            check_padding_side(padding_side)
            if tokenizer is None and padding_side == "left":
                raise ValueError("padding_side='left' reads the padding off the pad token id, which needs a tokenizer "
                                 "and this model has none: pass attention_mask= [batch pos] (1 = real token)")
        side = None if tokenizer is None else padding_side or tokenizer.padding_side
        if side is None or (side != "left" and not cached):
            return None
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        return mask_from_padding(tokens, tokenizer.pad_id, tokenizer.bos_id, side, prepend_bos)

    def validate_attention_mask(self, attention_mask: Optional[torch.Tensor], tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """A [pos] or [batch pos] mask of 1s (real tokens) and 0s (padding) for `tokens`, as [batch pos] long on
        their device; anything else (2s, 0.9s, an additive -1e4 mask, the wrong shape) is an error saying the fix."""
        return check_mask(attention_mask, tuple(tokens.shape), "the tokens'", tokens.device)

    def validate_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Check token ids before they reach an embedding lookup, where mistakes become cryptic."""
        if tokens.dtype in (torch.bool,) or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(
                f"token ids must be an integer tensor, got dtype {tokens.dtype}; use model.to_tokens(text) "
                "or tokens.long()"
            )
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"token ids must have shape [batch pos] or [pos], got shape {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if n == 0 or tokens.shape[0] == 0:
            raise ValueError(f"empty input: token ids of shape {tuple(tokens.shape)}")
        if n > self.cfg.n_ctx:
            raise ValueError(f"input has {n} tokens but the model's context is n_ctx={self.cfg.n_ctx}; truncate it")
        low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one read-back, not two: each waits for a GPU
        if self.negative_ids_from_the_end and -self.cfg.d_vocab <= low < 0:
            tokens, low = tokens.remainder(self.cfg.d_vocab), 0
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.d_vocab})")
        return tokens.to(self.device, torch.long)


    def _validate_residual(self, resid: torch.Tensor, start_at_layer: int) -> torch.Tensor:
        if not -self.cfg.n_layers <= start_at_layer <= self.cfg.n_layers:
            raise ValueError(f"start_at_layer={start_at_layer} is outside [-n_layers, n_layers={self.cfg.n_layers}] "
                             f"(negative counts from the end)")
        if not (isinstance(resid, torch.Tensor) and resid.is_floating_point() and resid.dim() == 3
                and resid.shape[-1] == self.cfg.d_model):
            shape = tuple(resid.shape) if isinstance(resid, torch.Tensor) else type(resid).__name__
            raise ValueError(
                f"with start_at_layer={start_at_layer} the input is the residual stream [batch pos d_model="
                f"{self.cfg.d_model}] (floating point), got {shape}; for token ids leave start_at_layer out (None)"
            )
        # like token ids, a residual from a cache stored elsewhere (device='cpu', dtype=bfloat16) is moved in
        return resid.to(self.device, self.embed.W_E.dtype)



def check_mask(attention_mask: Optional[torch.Tensor], shape: tuple[int, int], what: str, device) -> Optional[torch.Tensor]:
    """A [pos] or [batch pos] mask as [batch pos] long on `device`, or an error naming both shapes."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor [batch pos] (1 = real token), got {type(attention_mask).__name__}")
    if attention_mask.dim() == 1:
        attention_mask = attention_mask.unsqueeze(0)
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but {what} shape is {tuple(shape)}")
    if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        # .long() would read 0.9 as padding and 2 as a token that counts twice in the positions; an additive
        # mask (0 and -1e4 or -inf, as transformers builds internally) would mark every token real
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)].flatten()[0].item()
        raise ValueError(f"attention_mask must hold 1 (real token) and 0 (padding) only, got {bad:.6g}; for an additive "
                         "mask (0 = keep, negative = hide) pass (mask == 0).long(), for weights pass (mask > 0).long()")
    return attention_mask.to(device, torch.long)


def mask_from_padding(tokens: torch.Tensor, pad_id: int, bos_id: Optional[int], padding_side: str,
                      prepend_bos: bool) -> Optional[torch.Tensor]:
    """transformer-lens's get_attention_mask: [batch pos] long, 0 on the leading (left) or trailing (right) run of
    `pad_id` in each row (a pad id between real tokens is a token); with left padding and a prepended BOS that is
    the pad id, the run's last one is the BOS, and real. None when every position is real."""
    real = tokens != pad_id
    if padding_side == "right":
        padding = real.flip(-1).cumsum(-1).flip(-1) == 0
    else:
        padding = real.cumsum(-1) == 0
        if prepend_bos and bos_id == pad_id:
            rows = padding.any(-1).nonzero().flatten()
            padding[rows, padding[rows].sum(-1) - 1] = False
    mask = (~padding).long()
    return None if bool(mask.all()) else mask


def token_positions(attention_mask: Optional[torch.Tensor], batch: int, n_new: int, device) -> torch.Tensor:
    """[batch n_new]: the position of each new token, counting only real tokens before it, so left
    padding and a KV cache both continue the count rather than restart it."""
    if attention_mask is None:
        return torch.arange(n_new, device=device).expand(batch, n_new)
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, -n_new:]


def allowed_keys(attention_mask: Optional[torch.Tensor], positions: torch.Tensor,
                  sliding_window: Union[int, Chunk, None] = None, causal: bool = True) -> Optional[torch.Tensor]:
    """[batch 1 query_pos key_pos], which keys each new query (at `positions` [batch n_new], the last n_new of
    the mask's) may see: earlier (any, without `causal`) or itself, not padding, and with a sliding window fewer
    than `sliding_window` real tokens back (or, a Chunk, in the query's own chunk of real-token positions: Llama 4's
    chunked layers). Each query always sees itself, so a padded query's row stays finite
    (its values are meaningless but never NaN). None when the attention's own default says it all (causal, or
    every key without `causal`: no padding, no window reached)."""
    n_new = positions.shape[1]
    if attention_mask is None:
        reach = getattr(sliding_window, "size", sliding_window)  # (positions 0.. of the first chunk see all before)
        if not causal or reach is None or n_new <= reach:
            return None
        attention_mask = torch.ones(positions.shape, dtype=torch.long, device=positions.device)
    n_all = attention_mask.shape[1]
    device = attention_mask.device
    query_at = torch.arange(n_all - n_new, n_all, device=device)[:, None]
    key_at = torch.arange(n_all, device=device)[None, :]
    allowed = attention_mask.bool()[:, None, None, :]
    if causal:
        allowed = allowed & (key_at <= query_at)
    if sliding_window is not None:  # distances (or chunks) in real tokens, so padding never changes what a prompt sees
        key_positions = attention_mask.cumsum(dim=1) - 1  # [batch key_pos]
        if isinstance(sliding_window, Chunk):  # (transformers counts the chunks past the left padding too)
            size = sliding_window.size
            allowed &= (positions[:, None, :, None] // size) == (key_positions[:, None, None, :] // size)
        else:
            allowed &= (positions[:, None, :, None] - key_positions[:, None, None, :]) < sliding_window
    return allowed | (key_at == query_at)
