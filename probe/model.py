"""HookedDecoder: a GPT-2-style decoder whose every intermediate is a named hook point."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from hooks import HookedRootModule, HookPoint
from einops import repeat

from probe.attention import Attention, PerHeadInputs
from probe.config import DecoderConfig, NormPlacement
from probe.decoder_cache import DecoderCache
from probe.embedding import Embed, Unembed, make_pos_embed
from probe.kv_cache import KVCache
from probe.mlp import make_mlp
from probe.norm import FLOAT32_HOOK_NORMS, make_norm
from probe.shapes import PER_HEAD_INPUTS, hook_shapes
from probe.tl_surface import TransformerLensSurface, check_return_type, finish_output, refuse_unsupported
from probe.tokenizer import Tokenizer
from probe.tokens import TokenMethods, is_text
from probe.weight_views import WeightViews

ModelInput = Union[str, Sequence[str], torch.Tensor]
NORM_HOOKS = (".hook_scale", ".hook_normalized")


class PreNormBlock(nn.Module):
    """The pre-norm residual block (GPT-2, Llama): h = x + attn(ln1(x)); y = h + mlp(ln2(h))."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        self.ln2 = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.hook_resid_pre = HookPoint()  # [batch pos d_model]
        # per-head copies of what attention reads, before its norm (transformer-lens's use_attn_in and
        # use_split_qkv_input): computed only while hooked or cached by name, see attention_input
        self.hook_attn_in = HookPoint(opt_in=True, by_name=True)  # [batch pos head d_model]
        self.hook_q_input = HookPoint(opt_in=True, by_name=True)  # [batch pos head d_model]
        self.hook_k_input = HookPoint(opt_in=True, by_name=True)  # [batch pos kv_head d_model]
        self.hook_v_input = HookPoint(opt_in=True, by_name=True)  # [batch pos kv_head d_model]
        self.hook_attn_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_mid = HookPoint()  # [batch pos d_model]
        self.hook_mlp_in = HookPoint(opt_in=True)  # [batch pos d_model]: what the MLP reads, before its norm
        self.hook_mlp_out = HookPoint()  # [batch pos d_model]
        self.hook_resid_post = HookPoint()  # [batch pos d_model]

    def forward(self, resid_pre, positions, allowed=None, past=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_mid))))
        return self.hook_resid_post(resid_mid + mlp_out)

    def attention_input(self, resid: torch.Tensor, norm: nn.Module):
        """norm(resid) [batch pos d_model], what attention reads. While a per-head input point is hooked, each head
        reads its own copy instead, normed separately: PerHeadInputs of [batch pos head d_model] queries' and
        [batch pos kv_head d_model] keys' and values' inputs, so an edit reaches one head's q, k or v alone."""
        points = (self.hook_attn_in, self.hook_q_input, self.hook_k_input, self.hook_v_input)
        if not any(point.active for point in points):
            return norm(resid)
        # repeat may return a broadcast view of resid: a real copy, so an in-place edit stays in its head
        attn_in = self.hook_attn_in(repeat(resid, "batch pos d_model -> batch pos head d_model", head=self.attn.n_heads).clone())
        if self.attn.n_kv_heads != self.attn.n_heads and self.hook_attn_in.active:
            raise ValueError("hook_attn_in has one copy per query head, but this model's keys and values have fewer "
                             "heads (grouped-query attention); hook hook_k_input / hook_v_input instead")
        kv_in = attn_in if self.attn.n_kv_heads == self.attn.n_heads else repeat(
            resid, "batch pos d_model -> batch pos head d_model", head=self.attn.n_kv_heads)
        # copies made before any hook runs, so an in-place edit of a query input never reaches a key or value
        k_in, v_in = kv_in.clone(), kv_in.clone()
        q_in = self.hook_q_input(attn_in)
        return PerHeadInputs(norm(q_in), norm(self.hook_k_input(k_in)), norm(self.hook_v_input(v_in)))


class PostNormBlock(PreNormBlock):
    """The post-norm residual block (Vaswani et al. 2017, GPT-1): h = ln1(x + attn(x)); y = ln2(h + mlp(h)).

    Same components and hook names; resid_mid and resid_post are the normalised sums that flow on."""

    def forward(self, resid_pre, positions, allowed=None, past=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, nn.Identity()), positions, allowed, past))
        resid_mid = self.hook_resid_mid(self.ln1(resid_pre + attn_out))
        mlp_out = self.hook_mlp_out(self.mlp(self.hook_mlp_in(resid_mid)))
        return self.hook_resid_post(self.ln2(resid_mid + mlp_out))


class ParallelBlock(PreNormBlock):
    """The parallel residual block (GPT-NeoX, Pythia): y = x + attn(ln1(x)) + mlp(ln2(x)).

    Both sublayers read the same residual, so there is no residual between them: no hook_resid_mid."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        del self.hook_resid_mid

    def forward(self, resid_pre, positions, allowed=None, past=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past))
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(self.hook_mlp_in(resid_pre))))
        return self.hook_resid_post(resid_pre + attn_out + mlp_out)


class SandwichBlock(PreNormBlock):
    """Norms on both sides of each sublayer (Gemma 2): h = x + ln1_post(attn(ln1(x))); y = h + ln2_post(mlp(ln2(h))).

    hook_attn_out and hook_mlp_out are the normalised writes, what the residual stream receives."""

    def __init__(self, cfg: DecoderConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.ln1_post = make_norm(cfg)
        self.ln2_post = make_norm(cfg)

    def forward(self, resid_pre, positions, allowed=None, past=None):
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.ln1_post(self.attn(self.attention_input(resid_pre, self.ln1), positions, allowed, past)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        mlp_out = self.hook_mlp_out(self.ln2_post(self.mlp(self.ln2(self.hook_mlp_in(resid_mid)))))
        return self.hook_resid_post(resid_mid + mlp_out)


BLOCKS = {NormPlacement.PRE: PreNormBlock, NormPlacement.POST: PostNormBlock, NormPlacement.PARALLEL: ParallelBlock,
          NormPlacement.SANDWICH: SandwichBlock}
Block = PreNormBlock


class HookedDecoder(TokenMethods, WeightViews, TransformerLensSurface, HookedRootModule):
    """Token (+ position) embedding -> n_layers blocks -> final norm -> unembedding."""

    def __init__(self, cfg: DecoderConfig, tokenizer: Optional[Tokenizer] = None):
        super().__init__()
        prepend_bos = tokenizer is None or tokenizer.bos_id is not None
        self.cfg = cfg if cfg.default_prepend_bos == prepend_bos else dataclasses.replace(cfg, default_prepend_bos=prepend_bos)
        self.tokenizer = tokenizer
        self.embed = Embed(cfg.d_vocab, cfg.d_model, math.sqrt(cfg.d_model) if cfg.scale_embed else None)
        self.hook_embed = HookPoint()  # [batch pos d_model]
        self.pos_embed = make_pos_embed(cfg)  # None with rotary positions, which act inside attention
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()  # [batch pos d_model]
        self.blocks = nn.ModuleList([BLOCKS[cfg.norm_placement](cfg, layer) for layer in range(cfg.n_layers)])
        self.windows = {cfg.layer_window(layer) for layer in range(cfg.n_layers)}
        self.ln_final = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.unembed = Unembed(cfg.d_vocab, cfg.d_model, bias=cfg.unembed_bias, softcap=cfg.logit_softcap)
        if cfg.tied_embeddings:
            self.unembed.weight = self.embed.W_E
        self.init_weights()
        self.setup_hooks()
        self._follow_weights()

    def forward(
        self,
        input: ModelInput,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        return_type: Optional[str] = "logits",
        loss_per_token: bool = False,
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        start_at_layer: Optional[int] = 0,
        stop_at_layer: Optional[int] = None,
        tokens: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        **unsupported,
    ) -> torch.Tensor:
        """Logits [batch pos vocab] for token ids [batch pos] (or [pos]), a string, or a list of strings.

        A list of strings is padded on `padding_side` ("right" by default; "left" puts every prompt's last token
        at the last position). `attention_mask` [batch pos] (1 = real token) handles padding you did yourself,
        left or right: padded keys are hidden and positions count real tokens only, so a prompt's activations do
        not depend on what it was batched with. `prepend_bos=None` prepends BOS when the tokenizer has one.

        `return_type` is transformer-lens's: "logits", "loss" (the mean next-token cross-entropy, or [batch pos-1]
        with `loss_per_token=True`), "both" ((logits, loss)) or None. The loss counts every position of
        right-padded text, as transformer-lens does; left padding or an `attention_mask` leaves padding out.

        `start_at_layer=l` takes the residual stream [batch pos d_model] entering block l instead of
        tokens (give `tokens=` to score a loss); `stop_at_layer=l` returns the residual stream entering block l
        instead of logits. Together they rerun part of the model, e.g. from a cached residual.

        `kv_cache` (see `generate`) keeps every layer's keys and values: the input is then only the
        new tokens, and their positions continue where the cache ends.
        """
        refuse_unsupported(unsupported, "HookedDecoder.forward")
        check_return_type(return_type)
        start_at_layer = start_at_layer or 0  # transformer-lens passes None for "from the embeddings"
        if start_at_layer == 0:
            tokens, attention_mask = self._tokens_and_mask(input, attention_mask, padding_side, prepend_bos)
            batch, n_new = tokens.shape
        else:
            resid = self._validate_residual(input, start_at_layer)
            batch, n_new = resid.shape[:2]
            attention_mask = _check_mask(attention_mask, (batch, n_new), "the residual stream's [batch pos]", self.device)
        if stop_at_layer is not None:
            n_layers = self.cfg.n_layers
            stop = stop_at_layer + n_layers if stop_at_layer < 0 else stop_at_layer
            if not start_at_layer <= stop <= n_layers:
                # a slice would quietly run nothing, or every layer, and return a residual all the same
                raise ValueError(
                    f"stop_at_layer={stop_at_layer} must be in [start_at_layer={start_at_layer}, n_layers={n_layers}] "
                    f"(or negative, counting from the end)"
                )
        logits_mask = attention_mask
        device = self.device
        if kv_cache is not None:
            if start_at_layer != 0 or stop_at_layer is not None:
                # the cache must grow in every layer at once, or its length and mask stop matching the keys
                raise ValueError(
                    f"kv_cache needs a pass through every layer; got start_at_layer={start_at_layer}, "
                    f"stop_at_layer={stop_at_layer}"
                )
            if kv_cache.length + n_new > self.cfg.n_ctx:
                raise ValueError(
                    f"the KV cache holds {kv_cache.length} positions; {n_new} more would exceed n_ctx={self.cfg.n_ctx}"
                )
            new_mask = attention_mask if attention_mask is not None else torch.ones(batch, n_new, dtype=torch.long, device=device)
            attention_mask = kv_cache.extend_mask(new_mask)
        positions = _positions(attention_mask, batch, n_new, device)
        if start_at_layer == 0:
            resid = self.hook_embed(self.embed(tokens))
            if self.pos_embed is not None:
                resid = resid + self.hook_pos_embed(self.pos_embed(positions))
        # one mask per distinct window (Gemma 2 alternates a window with full attention)
        allowed = {window: _allowed_keys(attention_mask, positions, window) for window in self.windows}
        for index, block in enumerate(self.blocks[start_at_layer:stop_at_layer], start=start_at_layer):
            past = None if kv_cache is None else kv_cache.layers[index]
            resid = block(resid, positions, allowed[self.cfg.layer_window(index)], past)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        return finish_output(return_type, logits, tokens, logits_mask, loss_per_token)

    def make_cache(self, activations, has_batch_dim: bool = True) -> DecoderCache:
        return DecoderCache(activations, self, has_batch_dim)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half(): cfg.device follows the weights, as transformer-lens code expects of model.cfg.device
        out = super()._apply(fn, *args, **kwargs)
        self._follow_weights()
        return out

    def _follow_weights(self) -> None:
        device, dtype = str(self.device), self.embed.W_E.dtype
        if (device, dtype) != (self.cfg.device, self.cfg.dtype):
            self.cfg = dataclasses.replace(self.cfg, device=device, dtype=dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream entering block 0 for unpadded token ids [batch pos] -> [batch pos d_model]."""
        return self(tokens, stop_at_layer=0)

    def estimate_cache_bytes(self, names, dtype, input=None, attention_mask=None, *, start_at_layer=0,
                             stop_at_layer=None, kv_cache=None, **_) -> Optional[int]:
        """Bytes a cache of `names` takes for this input, from the hook shapes (see probe.shapes)."""
        if isinstance(input, torch.Tensor):
            batch, pos = (1, input.shape[0]) if input.dim() == 1 else tuple(input.shape[:2])
        elif is_text(input):
            if self.tokenizer is None:
                return None  # the forward pass will say what is missing
            texts = [input] if isinstance(input, str) else list(input)
            batch, pos = len(texts), (self.tokenizer.bos_id is not None) + max(len(self.tokenizer.encode(t)) for t in texts)
        else:
            return None
        key_pos = pos + (kv_cache.length if kv_cache is not None else 0)
        split = {int(n.split(".")[1]) for n in names if n.startswith("blocks.") and n.endswith(PER_HEAD_INPUTS)}
        shapes = hook_shapes(self.cfg, batch, pos, key_pos, per_head_input_layers=split)
        item = torch.empty((), dtype=dtype or self.embed.W_E.dtype).element_size()
        norm_item = 4 if dtype is None and self.cfg.norm in FLOAT32_HOOK_NORMS else item
        total = 0
        for name in names:
            if name in shapes:
                total += math.prod(shapes[name]) * (norm_item if name.endswith(NORM_HOOKS) else item)
                continue
            # a lent point (a spliced SAE's) says its width; [batch pos width] whatever it reads
            width = self.hook_point(name).width
            if width is None:
                return None  # not knowable here: no estimate rather than a low one
            total += batch * pos * width * item
        return total

    def _validate_residual(self, resid: torch.Tensor, start_at_layer: int) -> torch.Tensor:
        if not 0 < start_at_layer <= self.cfg.n_layers:
            raise ValueError(f"start_at_layer={start_at_layer} is outside [0, n_layers={self.cfg.n_layers}]")
        if not (isinstance(resid, torch.Tensor) and resid.is_floating_point() and resid.dim() == 3
                and resid.shape[-1] == self.cfg.d_model):
            shape = tuple(resid.shape) if isinstance(resid, torch.Tensor) else type(resid).__name__
            raise ValueError(
                f"with start_at_layer={start_at_layer} the input is the residual stream [batch pos d_model="
                f"{self.cfg.d_model}] (floating point), got {shape}"
            )
        # like token ids, a residual from a cache stored elsewhere (device='cpu', dtype=bfloat16) is moved in
        return resid.to(self.device, self.embed.W_E.dtype)

    @torch.no_grad()
    def generate(self, input: ModelInput = "", max_new_tokens: int = 10, **kwargs):
        """Continue prompts token by token with a key/value cache; see `probe.generation.generate`."""
        from probe.generation import generate

        return generate(self, input, max_new_tokens, **kwargs)

    def ledger(self, n_ctx: Optional[int] = None, dtype: torch.dtype = torch.float32):
        """Parameters, FLOPs per token and KV-cache bytes by component; see `probe.ledger.ledger`."""
        from probe.ledger import ledger

        return ledger(self.cfg, n_ctx=n_ctx, dtype=dtype)

    # ---- construction -------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation, for training from scratch (loading overwrites all of it)."""
        std = self.cfg.init_std
        for name, param in self.named_parameters():
            if name.endswith((".w",)):
                param.fill_(1.0)
            elif name.endswith((".b", ".bias")):
                param.zero_()
            elif name.endswith(("attn.out.weight", "mlp.fc_out.weight")):
                param.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))  # keeps the residual's variance flat in depth
            else:
                param.normal_(0.0, std)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: Union[str, Path],
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        revision: Optional[str] = None,
    ) -> "HookedDecoder":
        """Load a Hugging Face checkpoint (GPT-2, GPT-1, Llama, Qwen2, GPT-NeoX/Pythia): a local directory, a
        short name (`gpt2`, `gpt2-medium`, `pythia-160m`, ...) or a hub repository (`owner/name`).

        `revision`: a hub branch, tag or commit, e.g. one of Pythia's training checkpoints (`"step3000"`)."""
        from probe.loading import load_pretrained

        model = load_pretrained(name_or_path, device=device, dtype=dtype, revision=revision)
        prepend_bos = model.tokenizer is None or model.tokenizer.bos_id is not None
        model.cfg = dataclasses.replace(model.cfg, model_name=str(name_or_path), default_prepend_bos=prepend_bos)
        return model

    def save_pretrained(self, directory: Union[str, Path], overwrite: bool = False) -> Path:
        """Write a Hugging Face directory in this model's family (`config.json`, `model.safetensors`, `tokenizer.json`)."""
        from probe.loading import save_pretrained

        return save_pretrained(self, directory, overwrite=overwrite)

    # ---- tokens -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    def _tokens_and_mask(self, input: ModelInput, attention_mask: Optional[torch.Tensor],
                         padding_side: Optional[str] = None, prepend_bos: Optional[bool] = None):
        """Token ids on the model's device and their [batch pos] long mask (None: nothing padded)."""
        if is_text(input):
            if attention_mask is not None:
                raise ValueError("attention_mask is built for you when the input is text; pass token ids to give one")
            padding_side = padding_side or self._require_tokenizer().padding_side
            # never truncated here: text longer than n_ctx is refused (validate_tokens) rather than cut silently
            tokens, attention_mask = self.to_tokens(input, prepend_bos=prepend_bos, return_attention_mask=True,
                                                    padding_side=padding_side, truncate=False)
            if padding_side == "right" or bool(attention_mask.all()):
                # causal attention alone is exact for every real token when the padding comes after them, and it
                # gives the padded positions transformer-lens's values (they attend like real tokens)
                attention_mask = None
        elif isinstance(input, torch.Tensor):
            tokens = input
        elif isinstance(input, (list, tuple)) and not input:
            raise ValueError("the input is an empty list: give a string, a non-empty list of strings or token ids")
        else:
            raise TypeError(f"input must be a string, a list of strings or a tensor of token ids, got {type(input).__name__}")
        tokens = self.validate_tokens(tokens)
        return tokens, _check_mask(attention_mask, tuple(tokens.shape), "the tokens'", tokens.device)

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
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.d_vocab})")
        return tokens.to(self.device, torch.long)


def _check_mask(attention_mask: Optional[torch.Tensor], shape: tuple[int, int], what: str, device) -> Optional[torch.Tensor]:
    """A [pos] or [batch pos] mask as [batch pos] long on `device`, or an error naming both shapes."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor [batch pos] (1 = real token), got {type(attention_mask).__name__}")
    if attention_mask.dim() == 1:
        attention_mask = attention_mask.unsqueeze(0)
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but {what} shape is {tuple(shape)}")
    return attention_mask.to(device, torch.long)


def _positions(attention_mask: Optional[torch.Tensor], batch: int, n_new: int, device) -> torch.Tensor:
    """[batch n_new]: the position of each new token, counting only real tokens before it, so left
    padding and a KV cache both continue the count rather than restart it."""
    if attention_mask is None:
        return torch.arange(n_new, device=device).expand(batch, n_new)
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, -n_new:]


def _allowed_keys(attention_mask: Optional[torch.Tensor], positions: torch.Tensor,
                  sliding_window: Optional[int] = None) -> Optional[torch.Tensor]:
    """[batch 1 query_pos key_pos], which keys each new query (at `positions` [batch n_new], the last n_new of
    the mask's) may see: earlier or itself, not padding, and with a sliding window fewer than `sliding_window`
    real tokens back. Each query always sees itself, so a padded query's row stays finite (its values are
    meaningless but never NaN). None when plain causal attention says it all (no padding, no window reached)."""
    n_new = positions.shape[1]
    if attention_mask is None:
        if sliding_window is None or n_new <= sliding_window:
            return None
        attention_mask = torch.ones(positions.shape, dtype=torch.long, device=positions.device)
    n_all = attention_mask.shape[1]
    device = attention_mask.device
    query_at = torch.arange(n_all - n_new, n_all, device=device)[:, None]
    key_at = torch.arange(n_all, device=device)[None, :]
    allowed = (key_at <= query_at) & attention_mask.bool()[:, None, None, :]
    if sliding_window is not None:  # distances in real tokens, so padding never changes what a prompt sees
        key_positions = attention_mask.cumsum(dim=1) - 1  # [batch key_pos]
        allowed &= (positions[:, None, :, None] - key_positions[:, None, None, :]) < sliding_window
    return allowed | (key_at == query_at)
