"""HookedDecoder: a GPT-2-style decoder whose every intermediate is a named hook point."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from probe.hooks import HookedRootModule, HookPoint

from probe.block_choice import make_blocks
from probe.blocks import PADDING, mask_keys, masks_for
from probe.bridge_names import attach_bridge_attributes, bridge_names, describe_blocks_as_the_bridge
from probe.config import DecoderConfig
from probe.decoder_cache import DecoderCache
from probe.embedding import check_shortformer_pos_embed, make_embed, make_pos_embed
from probe.prediction_head import make_unembed
from probe.initialisation import init_weights
from probe.inputs import InputChecks, ModelInput, allowed_keys, check_mask, token_positions
from probe.kv_cache import KVCache, layer_caches, one_cache
from probe.moe import draw_as_transformer_lens_builds
from probe.norm import FLOAT32_HOOK_NORMS, make_norm
from probe.per_layer_block import PerLayerEmbed
from probe.sae_methods import SAEMethods
from probe.shapes import ID_HOOKS, PER_HEAD_INPUTS, hook_shapes
from probe.tl_bridge import BridgeSurface
from probe.tl_config import decoder_config
from probe.tl_state_dict import use_tl_layout
from probe.tl_state_processing import StateDictProcessing
from probe.tl_surface import (TransformerLensSurface, check_return_type, finish_output, refuse_unsupported,
                              tokenizer_with_side, with_tokenizer)
from probe.tokenizer import Tokenizer
from probe.tokens import TokenMethods, is_text
from probe.weight_views import WeightViews

NORM_HOOKS = (".hook_scale", ".hook_normalized")


class HookedDecoder(TokenMethods, WeightViews, TransformerLensSurface, StateDictProcessing, BridgeSurface, SAEMethods,
                    InputChecks, HookedRootModule):
    """Token (+ position) embedding -> n_layers blocks -> final norm -> unembedding."""

    def __init__(self, cfg: Union[DecoderConfig, dict], tokenizer: Optional[Tokenizer] = None,
                 move_to_device: bool = True, default_padding_side: Optional[str] = None):
        """`tokenizer`: probe's or a transformers tokenizer (converted). HookedTransformer's keywords:
        `move_to_device=False` leaves the weights on the CPU whatever cfg.device says; `default_padding_side` is the
        tokenizer's padding side."""
        super().__init__()
        cfg = decoder_config(cfg)  # transformer-lens code passes its HookedTransformerConfig, or a dict of it
        generator = torch.get_rng_state() if cfg.transformer_lens_init else None
        if tokenizer is None and cfg.tokenizer_source is not None:
            from probe.loading import load_tokenizer

            tokenizer = load_tokenizer(cfg.tokenizer_source)
        tokenizer = tokenizer_with_side(tokenizer, default_padding_side)
        self.cfg = with_tokenizer(cfg, tokenizer)
        self.tokenizer = tokenizer
        self.hook_tokens = HookPoint() if cfg.use_hook_tokens else nn.Identity()  # [batch pos] token ids
        self.embed = make_embed(cfg)
        self.hook_embed = HookPoint()  # [batch pos d_model]
        self.pos_embed = make_pos_embed(cfg)  # None with rotary positions, which act inside attention
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()  # [batch pos d_model]
        # Gemma 4 (E2B, E4B): every layer's own small embedding of each token
        self.per_layer_embed = None if cfg.per_layer_inputs is None else PerLayerEmbed(cfg)
        self.blocks = make_blocks(cfg)
        self.block_masks = mask_keys(cfg)
        self.windows = {cfg.layer_mask_key(layer) for layer in range(cfg.n_layers)}  # (Llama 4's chunks too)
        self.ln_final = make_norm(cfg, foldable=True, ends=True, eps=cfg.final_eps) if cfg.final_norm else nn.Identity()
        self.unembed = make_unembed(cfg)  # (W_U, after ModernBERT's prediction head where the config has one)
        if cfg.tied_embeddings:
            self.unembed.weight = self.embed.W_E
        aliases, left_out = bridge_names(cfg)  # transformer-lens 4's own names for the points
        self.setup_hooks(aliases, left_out)
        attach_bridge_attributes(self, aliases, left_out)
        describe_blocks_as_the_bridge(self)
        use_tl_layout(self)  # state_dict() in transformer-lens's names and shapes; load_state_dict takes both layouts
        if generator is not None:  # TL's modules start empty (but its experts' nn.Linear): building draws little
            torch.set_rng_state(generator)
            draw_as_transformer_lens_builds(cfg)
        self.init_weights()  # after the layout: a HookedTransformerConfig's model draws in TL's
        self.follow_config_switches()
        if cfg.device != "cpu" or cfg.dtype not in (None, torch.float32):  # a config that names them, as TL's can
            self.to(device=cfg.device if move_to_device else None, dtype=cfg.dtype)
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
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        tokens: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        shortformer_pos_embed: Optional[torch.Tensor] = None,
        past_kv_cache: Optional[KVCache] = None,
        **unsupported,
    ) -> torch.Tensor:
        """Logits [batch pos vocab] for token ids [batch pos] (or [pos]), a string, or a list of strings.

        A list of strings is padded on `padding_side` ("right" by default; "left" puts every prompt's last token
        at the last position). `attention_mask` [batch pos] (1 = real token) handles padding you did yourself,
        left or right: padded keys are hidden and positions count real tokens only, so a prompt's activations do
        not depend on what it was batched with. Token ids without a mask are read as transformer-lens reads them:
        left-padded when `padding_side` (else `model.tokenizer.padding_side`) is "left", the leading pad ids then
        masked (see `padding_of`). `prepend_bos=None` prepends BOS when the tokenizer has one.

        `return_type` is transformer-lens's: "logits", "loss" (the mean next-token cross-entropy, or [batch pos-1]
        with `loss_per_token=True`), "both" (`Output(logits, loss)`, a named tuple) or None. The loss counts every
        position of right-padded text, as transformer-lens does; left padding or an `attention_mask` leaves padding
        out.

        `start_at_layer=l` (0 too, as in transformer-lens) takes the residual stream [batch pos d_model] entering
        block l instead of tokens (give `tokens=` to score a loss); `stop_at_layer=l` returns the residual stream
        entering block l instead of logits. Together they rerun part of the model, e.g. from a cached residual.

        `kv_cache` (see `generate`) keeps every layer's keys and values: the input is then only the
        new tokens, and their positions continue where the cache ends. `past_kv_cache` is transformer-lens's name for
        it (`KVCache.init_cache(model.cfg, device, batch_size)`, as TL's cache class makes one).

        Shortformer models (positions added to every layer's queries and keys, not to the residual stream) compute
        their positions on a `start_at_layer` run too; `shortformer_pos_embed` [batch pos d_model] (transformer-lens's
        keyword, e.g. from `input_to_embed`) gives them instead.
        """
        refuse_unsupported(unsupported, "HookedDecoder.forward")
        kv_cache = one_cache(kv_cache, past_kv_cache)
        check_return_type(return_type)
        from_tokens = start_at_layer is None  # as in transformer-lens: any layer, 0 too, takes a residual
        start_at_layer = 0 if from_tokens else start_at_layer
        every_position = False  # a mask of the cached positions and the new ones, given with a residual
        if from_tokens:
            tokens, attention_mask = self.tokens_and_mask(input, attention_mask, padding_side, prepend_bos,
                                                          cached=kv_cache is not None)
            batch, n_new = tokens.shape
        else:
            resid = self._validate_residual(input, start_at_layer)
            if start_at_layer < 0:  # transformer-lens slices blocks[start_at_layer:]: -1 runs the last block
                start_at_layer += self.cfg.n_layers
            batch, n_new = resid.shape[:2]
            # after a KV cache, transformer-lens's input_to_embed(past_kv_cache=) hands back every position's mask
            every_position = kv_cache is not None and attention_mask is not None and attention_mask.shape[-1] != n_new
            seen = kv_cache.length if every_position else 0
            attention_mask = check_mask(attention_mask, (batch, seen + n_new), "the residual stream's [batch pos]", self.device)
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
            if self.cfg.bidirectional:
                raise ValueError("kv_cache: in a bidirectional model earlier positions attend to later ones, so their "
                                 "keys and values change with every new token and cannot be cached; run the whole "
                                 "sequence again instead")
            if (start_at_layer != 0 or stop_at_layer is not None) and not kv_cache.frozen:
                # the cache must grow in every layer at once, or its length and mask stop matching the keys
                raise ValueError(
                    f"kv_cache needs a pass through every layer; got start_at_layer={start_at_layer}, "
                    f"stop_at_layer={stop_at_layer}: freeze the cache (cache.freeze()) to read it from part of the model"
                )
            if kv_cache.length + n_new > self.cfg.n_ctx:
                raise ValueError(
                    f"the KV cache holds {kv_cache.length} positions; {n_new} more would exceed n_ctx={self.cfg.n_ctx}"
                )
            if every_position:
                held = kv_cache.attention_mask
                if not kv_cache.frozen and (held is None or held.shape[1] != attention_mask.shape[1]):
                    raise ValueError("a mask of every position goes with a cache that holds it: pass the mask "
                                     "input_to_embed(..., past_kv_cache=cache) returned, or the new tokens' mask alone")
                logits_mask = attention_mask[:, -n_new:]
            else:
                new_mask = attention_mask if attention_mask is not None else torch.ones(batch, n_new, dtype=torch.long, device=device)
                attention_mask = kv_cache.extend_mask(new_mask)
        positions = token_positions(attention_mask, batch, n_new, device)
        # what every block reads beside the residual: a shortformer's positions, or Gemma 4's per-layer inputs
        beside = check_shortformer_pos_embed(self.cfg, shortformer_pos_embed, from_tokens, (batch, n_new))
        if from_tokens:
            resid, beside = self.embed_at(tokens, positions)
        elif self.pos_embed is not None and beside is None and not self.cfg.positions_in_residual:
            resid, beside = self.pos_embed.place(resid, self.hook_pos_embed(self.pos_embed(tokens, positions=positions)))
        elif self.per_layer_embed is not None and tokens is not None:  # from the token ids, as the model computes them
            beside = self.per_layer_embed(tokens, self.embed(tokens))
        elif self.cfg.shared_blocks is not None and tokens is not None:  # Zamba2's shared blocks read the embeddings
            beside = self.embed(tokens)
        # one mask per distinct window (Gemma 2 alternates a window with full attention)
        causal = not self.cfg.bidirectional
        allowed = {window: allowed_keys(attention_mask, positions, window, causal) for window in self.windows}
        allowed[PADDING] = None if attention_mask is None else attention_mask[:, -n_new:].bool()
        pasts = layer_caches(kv_cache, self.cfg)  # (a layer reusing an earlier one's keys gets that one's)
        for index, block in enumerate(self.blocks[start_at_layer:stop_at_layer], start=start_at_layer):
            resid = block(resid, positions, masks_for(allowed, self.block_masks[index]), pasts[index], beside)
        if stop_at_layer is not None:
            return resid
        resid = self.ln_final(resid)
        if return_type is None:  # nothing to return: the unembedding is skipped, as HookedTransformer skips it
            return None
        return finish_output(return_type, self.unembed(resid), tokens, logits_mask, loss_per_token)

    def embed_at(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the residual entering block 0 for token ids [batch pos] at `positions` [batch pos], what every block reads
        beside it: a shortformer model's positions for its queries' and keys' inputs, Gemma 4's per-layer inputs
        [batch pos layer d], Zamba2's embeddings, None for the others)."""
        resid = self.hook_embed(self.embed(self.hook_tokens(tokens)))
        if self.per_layer_embed is not None:
            return resid, self.per_layer_embed(tokens, resid)
        if self.pos_embed is None:  # (Zamba2's shared blocks read the embeddings beside the residual)
            return resid, resid if self.cfg.shared_blocks is not None else None
        return self.pos_embed.place(resid, self.hook_pos_embed(self.pos_embed(tokens, positions=positions)))

    def make_cache(self, activations, has_batch_dim: bool = True, listed=None) -> DecoderCache:
        return DecoderCache(activations, self, has_batch_dim, listed)

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

    def estimate_cache_bytes(self, names, dtype, input=None, attention_mask=None, *, start_at_layer=None,
                             stop_at_layer=None, kv_cache=None, past_kv_cache=None, **_) -> Optional[int]:
        """Bytes a cache of `names` takes for this input, from the hook shapes (see probe.shapes)."""
        kv_cache = one_cache(kv_cache, past_kv_cache)
        if isinstance(input, torch.Tensor):
            batch, pos = (1, input.shape[0]) if input.dim() == 1 else tuple(input.shape[:2])
        elif is_text(input):
            if self.tokenizer is None:
                return None  # the forward pass will say what is missing
            texts = [input] if isinstance(input, str) else list(input)
            longest = max(len(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts)
            batch, pos = len(texts), (self.tokenizer.bos_id is not None) + longest
        else:
            return None
        key_pos = pos + (kv_cache.length if kv_cache is not None else 0)
        names = list(dict.fromkeys(self.hook_aliases.get(n, n) for n in names))  # a point named twice is stored once
        split = {int(n.split(".")[1]) for n in names if n.startswith("blocks.") and n.endswith(PER_HEAD_INPUTS)}
        shapes = hook_shapes(self.cfg, batch, pos, key_pos, per_head_input_layers=split)
        item = torch.empty((), dtype=dtype or self.embed.W_E.dtype).element_size()
        norm_item = 4 if dtype is None and self.cfg.norm in FLOAT32_HOOK_NORMS else item
        total = 0
        for name in names:
            if name in shapes:
                size = 8 if name in ID_HOOKS or name.endswith(".hook_expert_indices") else \
                    4 if name.endswith(".hook_expert_weights") else norm_item if name.endswith(NORM_HOOKS) else item
                total += math.prod(shapes[name]) * size
                continue
            # a lent point (a spliced SAE's) says its width; [batch pos width] whatever it reads
            width = self.hook_point(name).width
            if width is None:
                return None  # not knowable here: no estimate rather than a low one
            total += batch * pos * width * item
        return total

    @torch.no_grad()
    def generate(self, input: ModelInput = "", max_new_tokens: int = 10, **kwargs):
        """Continue prompts token by token with a key/value cache; see `probe.generation.generate`."""
        from probe.generation import generate

        return generate(self, input, max_new_tokens, **kwargs)

    def generate_stream(self, input: ModelInput = "", max_new_tokens: int = 10, max_tokens_per_yield: int = 25, **kwargs):
        """transformer-lens's streaming `generate` (TL 3.9's ids, or TL 4's text on a booted model); see
        `probe.generation_stream.generate_stream`."""
        from probe.generation_stream import generate_stream

        return generate_stream(self, input, max_new_tokens, max_tokens_per_yield, **kwargs)

    def ledger(self, n_ctx: Optional[int] = None, dtype: torch.dtype = torch.float32):
        """Parameters, FLOPs per token and KV-cache bytes by component; see `probe.ledger.ledger`."""
        from probe.ledger import ledger

        return ledger(self.cfg, n_ctx=n_ctx, dtype=dtype)

    # ---- construction -------------------------------------------------------------------------
    def init_weights(self) -> None:
        """GPT-2's initialisation, for training from scratch (loading overwrites all of it); HookedTransformer's
        draw for a model built from HookedTransformerConfig (`cfg.transformer_lens_init`): probe.initialisation."""
        init_weights(self)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: Union[str, Path],
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[Union[torch.dtype, str]] = None,
        revision: Optional[str] = None,
        device_map=None,
        max_memory=None,
        **transformer_lens_keywords,
    ) -> "HookedDecoder":
        """Load a Hugging Face checkpoint (GPT-2, GPT-1, Llama, Qwen2, GPT-NeoX/Pythia): a local directory, a
        short name (`gpt2`, `gpt2-medium`, `pythia-160m`, ...) or a hub repository (`owner/name`).

        `revision`: a hub branch, tag or commit, e.g. one of Pythia's training checkpoints (`"step3000"`).
        `device_map`: "auto", {layer: device} or a plan from `HookedDecoder.plan_device_map`, to spread the
        blocks over several devices (`max_memory` caps each device for "auto"); see probe/placement.py.
        transformer-lens's keywords (`fold_ln=`, `center_writing_weights=`, `center_unembed=`,
        `refactor_factored_attn_matrices=`, `default_prepend_bos=`, `default_padding_side=`, dtype names, ...) do
        what they do there; without a processing keyword the weights are the checkpoint's own (probe/tl_loading.py)."""
        from probe.checkpoints import prepends_bos_by_default
        from probe.tl_loading import finish_loading, load_model, parse_loading_keywords

        options = parse_loading_keywords(name_or_path, dtype, device, revision, transformer_lens_keywords, cls.__name__)
        if device_map is not None and device is not None:
            raise ValueError("pass device= (one device) or device_map= (several), not both")
        model = load_model(name_or_path, options, cls)
        # TL's default: BOS first where the tokenizer has one and the family was trained with it
        prepend_bos = ((model.tokenizer is None or model.tokenizer.bos_id is not None)
                       and prepends_bos_by_default(model.cfg.original_architecture))
        model.cfg = dataclasses.replace(model.cfg, model_name=str(name_or_path), default_prepend_bos=prepend_bos)
        finish_loading(model, options)
        if device_map is not None:
            from probe.placement import dispatch

            dispatch(model, device_map, max_memory)
        return model

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: Union[str, Path], **keywords) -> "HookedDecoder":
        """transformer-lens's name for a load that keeps the checkpoint's weights, which probe's from_pretrained
        does unless asked otherwise; its keywords as from_pretrained's."""
        from probe.tl_loading import NO_PROCESSING

        return cls.from_pretrained(name_or_path, **{**NO_PROCESSING, **keywords})

    @classmethod
    def plan_device_map(cls, cfg: DecoderConfig, max_memory=None, dtype: torch.dtype = torch.float32) -> dict[str, str]:
        """{part: device} for a model of `cfg` over the devices of `max_memory` ({"cuda:0": "40GiB", ...}; default:
        what is free), in layer order; sized on the meta device. See probe.placement.plan_device_map."""
        from probe.placement import plan_device_map

        return plan_device_map(cls, cfg, max_memory, dtype)

    def save_pretrained(self, directory: Union[str, Path], overwrite: bool = False) -> Path:
        """Write a Hugging Face directory in this model's family (`config.json`, `model.safetensors`, `tokenizer.json`)."""
        from probe.loading import save_pretrained

        return save_pretrained(self, directory, overwrite=overwrite)

    # ---- tokens (checking them: probe.inputs) ------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device
