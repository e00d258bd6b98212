"""transformer-lens's model-level surface on HookedDecoder: return types and losses, the use_* switches, token
positions, and clear refusals for the keywords probe does not take. A face over probe's one implementation."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

import probe.residual_stack as rs
from probe.blocks import ATTENTION_PARTS, attention_blocks
from probe.config import SWITCHES, DecoderConfig, Positions
from probe.processing import drop_norm_weights, process_weights_in_place, tl_processing_steps, untie_embeddings
from probe.attention import per_head
from probe.inputs import token_positions
from probe.kv_cache import one_cache
from probe.norm import folded_norm_weights
from probe.tl_state_dict import TL_BUFFERS, bridge_rank
from probe.tokenizer import Tokenizer, check_padding_side, prepends_bos

GUIDE = "docs/from_transformer_lens.md"
RETURN_TYPES = ("logits", "loss", "both", None)
PATTERN_HOOKS = ("hook_pattern", "hook_attn_scores")  # [batch head query_pos key_pos]; the rest [batch pos ...]

# transformer-lens keywords probe does not take, with what to do instead
UNSUPPORTED = {
    "past_kv_cache": "run the model itself with it, model(tokens, past_kv_cache=cache), as the first step of a loop",
    "pos_slice": "it is run_with_cache's keyword (the positions to store)",
    "left_attention_mask": "pass attention_mask= (1 = real token)",
    "one_zero_attention_mask": "pass attention_mask= (1 = real token)",
}


def refuse_unsupported(kwargs: dict, where: str, hints: Optional[dict] = None) -> None:
    """A TypeError that names the probe equivalent for a transformer-lens keyword (`hints`: the caller's own, beside
    the forward's), or the unknown keyword itself."""
    hints = UNSUPPORTED if hints is None else {**UNSUPPORTED, **hints}
    for name in kwargs:
        hint = hints.get(name)
        if hint is not None:
            raise TypeError(f"{where} does not take {name}= (a transformer-lens keyword): {hint}; see {GUIDE}")
        raise TypeError(f"{where} got an unexpected keyword argument {name!r}; see {GUIDE} for transformer-lens's")


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
            per_token: bool = False) -> torch.Tensor:
    """Next-token cross-entropy as transformer-lens computes it: [batch pos-1] per token, else the mean over
    predicted positions; with a mask, a position counts only when it and the next token are real."""
    log_probs = F.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)
    tokens = tokens.to(logits.device)
    predicted = log_probs[..., :-1, :].gather(-1, tokens[..., 1:, None])[..., 0]
    if attention_mask is None:
        return -predicted if per_token else -predicted.mean()
    attention_mask = attention_mask.to(logits.device).bool()
    if attention_mask.shape != tokens.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the tokens {tuple(tokens.shape)}")
    counted = attention_mask[:, :-1] & attention_mask[:, 1:]
    predicted = predicted.masked_fill(~counted, 0.0)
    return -predicted if per_token else -predicted.sum() / counted.sum()


class Output(NamedTuple):
    """forward's return_type="both", transformer-lens's `Output`: `out.logits` [batch pos vocab] and `out.loss`, and
    a tuple, so `logits, loss = model(x, return_type="both")` works as well."""

    logits: torch.Tensor
    loss: torch.Tensor


def finish_output(return_type: Optional[str], logits: torch.Tensor, tokens: Optional[torch.Tensor],
                  attention_mask: Optional[torch.Tensor], loss_per_token: bool):
    """What forward returns for transformer-lens's `return_type` ("logits", "loss" or "both"; None returns before
    the unembedding)."""
    if return_type == "logits":
        return logits
    if tokens is None:
        raise ValueError(f"return_type={return_type!r} needs the tokens to score: with start_at_layer, pass tokens=")
    loss = lm_loss(logits, tokens, attention_mask, per_token=loss_per_token)
    return loss if return_type == "loss" else Output(logits, loss)


def check_return_type(return_type) -> None:
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type={return_type!r} is not one of 'logits', 'loss', 'both' or None")


def tokenizer_with_side(tokenizer, default_padding_side: Optional[str]) -> Optional[Tokenizer]:
    """probe's Tokenizer for `tokenizer` (a transformers tokenizer converted), padding on `default_padding_side` when
    given (transformer-lens's keyword of HookedTransformer(...) and set_tokenizer)."""
    if tokenizer is None:  # (a side given without a tokenizer sets nothing, as in TL)
        return None
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_transformers(tokenizer)
    if default_padding_side is not None:
        tokenizer.padding_side = check_padding_side(default_padding_side)
    return tokenizer


def with_tokenizer(cfg: DecoderConfig, tokenizer: Optional[Tokenizer]) -> DecoderConfig:
    """`cfg` with what transformer-lens's set_tokenizer records of a model's tokenizer: BOS is prepended by default only
    when the tokenizer has one (and the config says so), and `tokenizer_prepends_bos` says whether the tokenizer,
    called on text, puts a token first by itself (TL's test, `len(tokenizer.encode("")) > 0`; None without one)."""
    record = {"default_prepend_bos": prepends_bos(cfg.default_prepend_bos, tokenizer),
              "tokenizer_prepends_bos": None if tokenizer is None else len(tokenizer("")["input_ids"]) > 0}
    if all(getattr(cfg, name) is value for name, value in record.items()):
        return cfg
    return dataclasses.replace(cfg, **record)


class TransformerLensSurface:
    """Mixed into HookedDecoder: transformer-lens methods that are not hooks, weights or tokens."""

    def loss_fn(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                per_token: bool = False) -> torch.Tensor:
        """transformer-lens's `loss_fn`: next-token cross-entropy of `logits` [batch pos vocab] for `tokens`."""
        return lm_loss(logits, tokens, attention_mask, per_token)

    # ---- transformer-lens's use_* switches ----------------------------------------------------------------
    @property
    def cfg(self) -> DecoderConfig:
        return self.__dict__["_cfg"]

    @cfg.setter
    def cfg(self, cfg: DecoderConfig) -> None:
        # the model owns its config, so `model.cfg.use_attn_result = True` can reach set_use_attn_result, as it
        # turns the switch on in transformer-lens; a config another model owns is copied, not taken over
        owner = cfg.__dict__.get("_owner")
        if owner is not None and owner() not in (None, self):
            cfg = dataclasses.replace(cfg)
        object.__setattr__(cfg, "_owner", weakref.ref(self))
        self.__dict__["_cfg"] = cfg

    def __setstate__(self, state: dict) -> None:
        # a deepcopy or an unpickled model: its config came without an owner (DecoderConfig leaves the weak
        # reference out of its state), and is this model's own
        super().__setstate__(state)
        self.cfg = self.__dict__["_cfg"]

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Whether a cache of everything includes each head's write, `attn.hook_result` [batch pos head d_model].
        probe computes it whenever it is hooked or cached by name either way; this only changes the default."""
        for block in attention_blocks(self.blocks):
            block.attn.hook_result.opt_in = not use_attn_result
        self._record_switch(use_attn_result=bool(use_attn_result))

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Whether a cache of everything includes each head's own query, key and value input, `blocks.l.hook_q_input`
        / `hook_k_input` / `hook_v_input` [batch pos head d_model] (the residual before the norm). They exist and
        work whenever hooked or cached by name either way. While it is on, they are copies of the residual of their own,
        and `hook_attn_in` (set_use_attn_in) only observes: an edit there reaches nothing, as in transformer-lens."""
        self._include_by_default(("hook_q_input", "hook_k_input", "hook_v_input"), use_split_qkv_input)
        for block in attention_blocks(self.blocks):  # then hook_attn_in only observes, as in transformer-lens
            block.split_qkv_input = bool(use_split_qkv_input)
        self._record_switch(use_split_qkv_input=bool(use_split_qkv_input))

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """The same for `blocks.l.hook_attn_in` [batch pos head d_model], one per-head input for all of q, k and v."""
        self._include_by_default(("hook_attn_in",), use_attn_in)
        self._record_switch(use_attn_in=bool(use_attn_in))

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """The same for `blocks.l.hook_mlp_in` [batch pos d_model], the residual the MLP reads, before its norm."""
        self._include_by_default(("hook_mlp_in",), use_hook_mlp_in)
        self._record_switch(use_hook_mlp_in=bool(use_hook_mlp_in))

    def limit_context(self, n_ctx: int) -> None:
        """What `model.cfg.n_ctx = n` does (transformer-lens code assigns it: EAP-IG narrows it around a
        `to_tokens(truncate=True)` call, then puts it back): the longest input the model takes and the length
        `to_tokens` cuts to. A model with a table of learned positions takes at most the table's length; the
        weights do not change, so `save_pretrained` refuses a model whose n_ctx is not its table's."""
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive int, got {n_ctx!r}")
        table = self.positions_held
        if table is not None and n_ctx > table:
            raise ValueError(f"n_ctx={n_ctx} is longer than this model's {table} positions (pos_embed.W_pos): "
                             f"give at most {table}")
        self.cfg = dataclasses.replace(self.cfg, n_ctx=n_ctx)

    @property
    def positions_held(self) -> Optional[int]:
        """How many positions the model's table holds (learned, sinusoidal or shortformer), the most `n_ctx` can
        be; None for rotary positions, which need no table."""
        return None if self.pos_embed is None else self.pos_embed.W_pos.shape[0]

    def set_ungroup_grouped_query_attention(self, ungroup_grouped_query_attention: bool) -> None:
        """transformer-lens's switch to compute keys and values per query head on a grouped-query model: hook_k,
        hook_v (and rotary's and Qwen3's norms' k hooks) then hold [batch pos head d_head], and hook_k_input /
        hook_v_input [batch pos head d_model], so an edit reaches one query head's key or value alone (EAP-IG scores
        Llama's edges so). The weights stay grouped (W_K [kv_head d_model d_head]); the forward's values do not
        change. probe's circuit analyses score a grouped model per key/value head either way."""
        on = bool(ungroup_grouped_query_attention)
        if on and self.cfg.qk_norm_over_heads and self.cfg.n_kv_heads != self.cfg.n_heads:
            raise ValueError("this model normalises its keys over all key/value heads together (OLMo 2's k_norm), "
                             "which a copy per query head would change; keep ungroup_grouped_query_attention off")
        self._hook_key_values(per_query_head=on)
        self._record_switch(ungroup_grouped_query_attention=on)

    @contextlib.contextmanager
    def grouped_key_values(self):
        """Inside the block, keys and values are hooked once per key/value head whatever
        `ungroup_grouped_query_attention` says, and the switch's effect is back after: probe's circuit analyses
        read them so, with EAP-IG's setup (the switch on) left as the user made it."""
        blocks = attention_blocks(self.blocks)
        held = [block.attn.hooked_kv_heads for block in blocks]  # a block inside another's puts back the outer's
        self._hook_key_values(per_query_head=False)
        try:
            yield self
        finally:
            for block, heads in zip(blocks, held):
                block.attn.hooked_kv_heads = heads

    def _hook_key_values(self, per_query_head: bool) -> None:
        for block in attention_blocks(self.blocks):
            block.attn.hooked_kv_heads = block.attn.n_heads if per_query_head else block.attn.n_kv_heads

    def untie_embeddings(self) -> None:
        """Give `W_U` its own copy of a tied `W_E`, as transformer-lens's HookedTransformer always has them. A tied
        checkpoint (GPT-2, Gemma) holds one matrix for both, as transformers does, so an edit of one is an edit of
        the other: abliteration's `model.W_E.data = orthogonalized` then changes the unembedding too, where TL's
        leaves it. Loading with TL's processing (fold_ln, center_unembed, ...) unties them already."""
        untie_embeddings(self)

    # ---- transformer-lens's parameters by its own names ---------------------------------------------------
    def tl_parameters(self) -> dict[str, torch.Tensor]:
        """transformer-lens 4's `tl_parameters()`, which is its bridge's `get_params()` (what its SVDInterpreter
        reads): every weight under TL's name and shape (`blocks.0.attn.W_Q` [head d_model d_head], `mlp.W_in`,
        `unembed.W_U`, ...) in the bridge's order, a grouped-query model's key and value weights repeated per query
        head (`W_K`, `b_K`, ...; `state_dict()` keeps them per key/value head as `_W_K`, TL 3's names), and a folded
        norm's w = 1 (and b = 0), as the bridge keeps them. In the autograd graph of probe's own parameters, so a loss
        on them sends gradients to the fused weights (they are computed from them: an optimiser still takes
        `model.parameters()`)."""
        params = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            if name.rsplit(".", 1)[-1] in TL_BUFFERS:  # weights only: not TL's mask and IGNORE
                continue
            if ".attn._" in name:  # blocks.{l}.attn._W_K: [kv_head ...]
                heads = self.cfg.layer_heads(int(name.split(".")[1]))
                name, tensor = name.replace(".attn._", ".attn."), per_head(tensor, heads, 0)
            params[name] = tensor
        for name, module in self.named_modules():  # the norms the bridge lists (not Gemma 2's ln*_post, q/k norms)
            if name.rsplit(".", 1)[-1] in ("ln1", "ln2", "ln_final"):
                params.update(folded_norm_weights(module, name))
        return dict(sorted(params.items(), key=lambda item: bridge_rank(item[0])))

    def tl_named_parameters(self):
        """transformer-lens's `tl_named_parameters()`: `tl_parameters()` as (name, tensor) pairs."""
        return iter(self.tl_parameters().items())

    # ---- transformer-lens's processing and tokenizer methods, on a model already built -----------------------
    def process_weights_(self, fold_ln: Optional[bool] = None, center_writing_weights: Optional[bool] = None,
                         center_unembed: Optional[bool] = None, refactor_factored_attn_matrices: Optional[bool] = None,
                         fold_value_biases: Optional[bool] = None) -> None:
        """transformer-lens's `process_weights_`: this model's own weights processed in place (probe.processing).
        A step left out (None) gets TL's default, skipped with a warning where this model cannot take it, as TL
        skips it; a step asked for that the model cannot take is refused."""
        if fold_ln is not False and not self.cfg.norm_weights:
            warnings.warn("fold_ln: this model's norms have no weights (folded already, or LNPre / RMSPre); skipping "
                          "fold_ln, as transformer-lens skips it", stacklevel=2)
            fold_ln = False
        given = {name: value for name, value in (
            ("fold_ln", fold_ln), ("center_writing_weights", center_writing_weights), ("center_unembed", center_unembed),
            ("refactor_factored_attn_matrices", refactor_factored_attn_matrices),
            ("fold_value_biases", fold_value_biases)) if value is not None}
        with torch.no_grad():
            process_weights_in_place(self, **tl_processing_steps(self.cfg, given, "process_weights_", stacklevel=3))

    def load_and_process_state_dict(self, state_dict: dict, fold_ln: Optional[bool] = None,
                                    center_writing_weights: Optional[bool] = None, center_unembed: Optional[bool] = None,
                                    fold_value_biases: Optional[bool] = None,
                                    refactor_factored_attn_matrices: Optional[bool] = None) -> None:
        """transformer-lens's `load_and_process_state_dict`: `load_state_dict(state_dict)` (strict; TL's layout or
        probe's), then `process_weights_`. A state dict without norm weights was processed already (TL saves its
        processed models so): the norms then learn none and fold_ln is skipped, as TL skips it."""
        if self.cfg.norm_weights and not any(key.endswith((".ln1.w", ".ln2.w", "ln_final.w")) for key in state_dict):
            drop_norm_weights(self)  # the state dict's norms were folded already
        self.load_state_dict(state_dict, strict=True)
        self.process_weights_(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                              center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                              refactor_factored_attn_matrices=refactor_factored_attn_matrices)

    def set_tokenizer(self, tokenizer, default_padding_side: Optional[str] = None) -> None:
        """transformer-lens's `set_tokenizer`: a probe Tokenizer, or a transformers (fast) tokenizer, converted.
        BOS is prepended by default when the tokenizer has one and the config says so."""
        tokenizer = tokenizer_with_side(tokenizer, default_padding_side)
        self.tokenizer = tokenizer
        self.cfg = with_tokenizer(self.cfg, tokenizer)

    @property
    def n_params_total(self) -> int:
        """transformer-lens's count of every parameter (a tied embedding once), as transformers' num_parameters()."""
        return sum(p.numel() for p in self.parameters())

    def mps(self):
        """transformer-lens's `model.mps()`: the model on Apple's MPS device."""
        return self.to(torch.device("mps"))

    def follow_config_switches(self) -> None:
        """Turn on the use_* switches the config says are on (a config built by HookedTransformerConfig(...,
        use_attn_result=True), or copied from a model that set them)."""
        for switch in SWITCHES:
            if getattr(self.cfg, switch):
                getattr(self, f"set_{switch}")(True)

    def _record_switch(self, **switch: bool) -> None:
        # in place, so every name for model.cfg reads it: the model's config is its own (the cfg setter)
        for name, on in switch.items():
            object.__setattr__(self.cfg, name, on)

    def _include_by_default(self, names: tuple[str, ...], on: bool) -> None:
        per_head = any(name in ATTENTION_PARTS for name in names)  # (a linear-attention block has hook_mlp_in only)
        for block in attention_blocks(self.blocks) if per_head else self.blocks:
            for name in names:
                getattr(block, name).opt_in = not on

    def slice_cached_positions(self, store: dict[str, torch.Tensor], pos_slice) -> dict[str, torch.Tensor]:
        """transformer-lens's run_with_cache(pos_slice=...): each cached activation (and gradient) kept at those
        positions only, along its position axis (the query axis of pattern and attn_scores), which stays even for
        an int (pos_slice=-1 stores [batch 1 ...]), as transformer-lens's. The positions become an index tensor:
        indexing with it copies, so the rest of the forward's activations are freed, not kept alive under views."""
        spec = rs.to_index(pos_slice)

        def kept(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            index = torch.arange(tensor.shape[dim])[spec].reshape(-1)  # an int keeps its axis: [1]
            return rs.take(tensor, index, dim)

        return {name: kept(tensor, -2 if name.removesuffix("_grad").endswith(PATTERN_HOOKS) else 1)
                for name, tensor in store.items()}

    def input_to_embed(self, input, prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None,
                       attention_mask: Optional[torch.Tensor] = None, past_kv_cache=None):
        """transformer-lens's first step of the forward: `(residual, tokens, shortformer_pos_embed, attention_mask)`,
        the residual [batch pos d_model] entering block 0 (run the rest with `model(residual, start_at_layer=0, ...)`
        or the blocks), the token ids, a shortformer model's positions [batch pos d_model] (None for the others,
        whose positions are in the residual or rotary), and the mask: None when nothing is padded, but all ones
        when the tokenizer pads on the left, as TL returns it (its mask then comes from the ids whatever they hold). With
        `past_kv_cache`, as TL's: positions continue where the cache ends, the new tokens' mask joins the cache's
        unless it is frozen, and the mask returned is every position's [batch past+pos], which
        `model(residual, start_at_layer=l, attention_mask=mask, past_kv_cache=cache)` takes."""
        if past_kv_cache is not None:
            return self._input_to_embed_after(past_kv_cache, input, prepend_bos, padding_side, attention_mask)
        tokens, attention_mask = self.tokens_and_mask(input, attention_mask, padding_side, prepend_bos)
        # the padding is read once, above: padding_side="right" keeps the forward from reading the ids again
        residual = self(tokens, attention_mask=attention_mask, padding_side="right", stop_at_layer=0)
        shortformer = self.cfg.positions is Positions.SHORTFORMER
        positions = self.pos_embed(tokens, attention_mask=attention_mask) if shortformer else None
        if attention_mask is None and self.tokenizer is not None and self.tokenizer.padding_side == "left":
            attention_mask = torch.ones_like(tokens)
        return residual, tokens, positions, attention_mask

    def _input_to_embed_after(self, cache, input, prepend_bos, padding_side, attention_mask):
        cache = one_cache(None, cache)
        tokens, new_mask = self.tokens_and_mask(input, attention_mask, padding_side, prepend_bos, cached=True)
        every = cache.extend_mask(torch.ones_like(tokens) if new_mask is None else new_mask)
        residual, beside = self.embed_at(tokens, token_positions(every, *tokens.shape, self.device))
        # what blocks read beside the residual is a shortformer's positions, or per-layer inputs the forward recomputes
        return residual, tokens, beside if self.cfg.positions is Positions.SHORTFORMER else None, every

    # ---- positions -----------------------------------------------------------------------------------
    def get_token_position(self, single_token: Union[str, int], input: Union[str, torch.Tensor],
                           mode: str = "first", prepend_bos: Optional[bool] = None, **_) -> int:
        """Index of the first (or last) occurrence of `single_token` in one prompt, as transformer-lens's."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        tokens = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else input
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"get_token_position takes one prompt, got a batch of {tokens.shape[0]}")
            tokens = tokens[0]
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        where = (tokens == token).nonzero().flatten().tolist()
        if not where:
            raise ValueError(f"token {token} ({self.tokenizer.token_strings([token])[0]!r}) is not in the input")
        return where[0] if mode == "first" else where[-1]
