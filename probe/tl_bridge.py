"""transformer-lens 4's loading line, `TransformerBridge.boot_transformers(name)` then optionally
`enable_compatibility_mode()`, on HookedDecoder: TL 4 code runs with only the class on that line changed.

A booted model is the checkpoint's own weights (as the bridge's) and names its hooks as the bridge does
(`bridge_names`): its own names (`blocks.0.hook_out`, `blocks.0.attn.q.hook_out`, probe/bridge_names.py) beside the
classic ones, in name predicates and in a cache of everything too. `enable_compatibility_mode()` processes the
weights as HookedTransformer would (the bridge's defaults), and the names stay as they are."""
from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from probe.hooks import HookPoint, UnknownNameError
from probe.tl_surface import refuse_unsupported
from probe.tl_native import draw_like_native, native_config, native_settings
from probe.transformers_model import initialised_like_transformers, to_transformers

BOOT_HINTS = {
    "hf_config_overrides": "probe reads the checkpoint's config.json as saved; edit a copy of the directory's "
                           "config.json, or build the model from a DecoderConfig",
    "model_class": "probe builds its own decoder for each family it loads; leave model_class out",
    "n_ctx": "probe uses the checkpoint's context length; run shorter inputs, or edit a copy of its config.json",
    "checkpoint_index": "pass checkpoint_value=<step> or revision='step<N>'",
}

# the families whose TL 4.3 adapters declare a processing step unsupported (`supports_fold_ln`,
# `supports_center_writing_weights`), which the bridge's enable_compatibility_mode then skips with a warning:
# the hybrids, GLM's, OLMo 2's write-norm blocks (the final norm stays too), and Nemotron's offset LayerNorms
BRIDGE_SKIPS = {**dict.fromkeys(("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                                 "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "GlmForCausalLM",
                                 "Glm4ForCausalLM", "Glm4vForConditionalGeneration", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoHybridForCausalLM", "FlexOlmoForCausalLM",
                                 "Exaone4ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                 "Glm4MoeLiteForCausalLM", "YoutuForCausalLM", "GlmMoeDsaForCausalLM",
                                 "GraniteMoeHybridForCausalLM",
                                 "BambaForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM",
                                 "NemotronHForCausalLM", "Zamba2ForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
                                 "Gemma4UnifiedForConditionalGeneration", "AfmoeForCausalLM",
                                 "JetMoeForCausalLM", "NanoChatForCausalLM", "RwkvForCausalLM",
                                 "LagunaForCausalLM"),
                                ("fold_ln",)),
                "NemotronForCausalLM": ("fold_ln", "center_writing_weights"),
                "BitNetForCausalLM": ("fold_ln", "center_writing_weights"),  # (its sub-norms: the adapter folds nothing)
                "ModernBertDecoderForCausalLM": ("fold_ln", "center_writing_weights")}  # (its layer 0 reads raw)


class BridgeSurface:
    """transformer-lens 4's TransformerBridge entry points, mixed into HookedDecoder."""

    compatibility_mode = False  # the bridge's flag: True once enable_compatibility_mode() has run

    @classmethod
    def boot_transformers(cls, model_name, hf_config_overrides: Optional[dict] = None,
                          device: Optional[Union[str, torch.device]] = None, dtype: torch.dtype = torch.float32,
                          tokenizer: Any = None, load_weights: bool = True, trust_remote_code: bool = False,
                          model_class: Optional[type] = None, hf_model: Any = None, device_map=None,
                          n_devices: Optional[int] = None, max_memory=None, n_ctx: Optional[int] = None,
                          revision: Optional[str] = None, checkpoint_index: Optional[int] = None,
                          checkpoint_value: Optional[int] = None):
        """transformer-lens 4's `TransformerBridge.boot_transformers`: the checkpoint's own weights, unprocessed, with
        the bridge's hook names beside the classic ones (`bridge_names` is True). `trust_remote_code` changes
        nothing: probe runs its own code for every family it loads. `load_weights=False` gives the checkpoint's
        architecture with the weights `transformers` initialises it with (its `from_config`, drawing from torch's
        global stream as the bridge's does), and needs `transformers`. Keywords that would load something other than
        the checkpoint as saved (`hf_config_overrides`, `model_class`, `n_ctx`) are refused with what to do
        instead."""
        asked = {"hf_config_overrides": hf_config_overrides or None, "model_class": model_class, "n_ctx": n_ctx,
                 "checkpoint_index": checkpoint_index}
        refuse_unsupported({name: value for name, value in asked.items() if value is not None},
                           "HookedDecoder.boot_transformers()", BOOT_HINTS)
        if not load_weights and hf_model is None:  # a model given is booted as it is, as the bridge boots it
            hf_model = initialised_like_transformers(model_name, revision)
        optional = {"tokenizer": tokenizer, "hf_model": hf_model, "checkpoint_value": checkpoint_value,
                    "n_devices": n_devices}
        model = cls.from_pretrained_no_processing(
            model_name, device=device, dtype=dtype, revision=revision, device_map=device_map, max_memory=max_memory,
            **{name: value for name, value in optional.items() if value is not None})
        model.bridge_names = True
        return model.eval()  # as the bridge boots (TL 4's patching tools refuse a model in training mode)

    @classmethod
    def boot_native(cls, config, tokenizer: Any = None, device: Optional[Union[str, torch.device]] = None,
                    dtype: Optional[torch.dtype] = None, model_name: Optional[str] = None):
        """transformer-lens 4's `TransformerBridge.boot_native`: the toy model TL 4 builds from a
        `TransformerBridgeConfig` (TL's own object, or a dict of its fields), with TL 4's initial weights and its
        use of torch's random stream (probe/tl_native.py), named as the bridge names it, in training mode as TL 4
        returns it. `tokenizer` becomes the model's; `model_name` names it."""
        fields = native_settings(config)
        cfg = native_config(fields)
        if model_name is not None:
            cfg = dataclasses.replace(cfg, model_name=model_name)
        with torch.random.fork_rng(devices=[]):  # building draws nothing from the caller's stream; TL's draw below does
            model = cls(cfg)
        draw_like_native(model, fields)
        if tokenizer is not None:
            model.set_tokenizer(tokenizer)
        model.to(device=device, dtype=dtype)
        model.bridge_names = True
        return model

    def enable_compatibility_mode(self, disable_warnings: bool = False, no_processing: bool = False,
                                  fold_ln: bool = True, center_writing_weights: bool = True, center_unembed: bool = True,
                                  fold_value_biases: bool = True, refactor_factored_attn_matrices: bool = False) -> None:
        """transformer-lens 4's `enable_compatibility_mode`: the weights processed in place as HookedTransformer
        processes them (these defaults are the bridge's), or left alone with `no_processing=True`. A step this model
        cannot take (centring an RMSNorm model's writers) is skipped with a warning, as the bridge skips it. The
        classic names work with or without it; the bridge's stay too. `disable_warnings` is accepted: probe has no
        deprecation warnings for either set of names."""
        self.bridge_names_first = False  # the bridge's hooks see the classic names from here on, where there are any
        self.compatibility_mode = True
        asked = {"fold_ln": fold_ln, "center_writing_weights": center_writing_weights}
        skipped = [step for step in BRIDGE_SKIPS.get(self.cfg.original_architecture, ()) if asked[step] and not no_processing]
        if skipped:
            warnings.warn(f"enable_compatibility_mode: skipping {', '.join(skipped)}, which transformer-lens 4's bridge "
                          f"does not apply to {self.cfg.original_architecture} models (it leaves their norms as "
                          "they are); process_weights(...) takes them", stacklevel=2)
            fold_ln = fold_ln and "fold_ln" not in skipped
            center_writing_weights = center_writing_weights and "center_writing_weights" not in skipped
        if not no_processing:
            self.process_weights(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                 center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                                 refactor_factored_attn_matrices=refactor_factored_attn_matrices)

    def process_weights(self, verbose: bool = False, fold_ln: bool = True, center_writing_weights: bool = True,
                        center_unembed: bool = True, fold_value_biases: bool = True,
                        refactor_factored_attn_matrices: bool = False) -> None:
        """The bridge's `process_weights`: these steps applied in place (`process_weights_`; `verbose` is accepted).
        `probe.process_weights(model)` returns a processed copy instead."""
        self.process_weights_(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                              center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                              refactor_factored_attn_matrices=refactor_factored_attn_matrices)

    @property
    def original_model(self):
        """The bridge's `original_model`: this model as a `transformers` model of its checkpoint's family, with its
        weights as they are now (processed ones too), for code that takes a Hugging Face model (lm-eval's HFLM).
        Each access builds a new one, which probe's hooks do not reach and whose weights are its own: keep the
        reference (`hf_model = model.original_model`) and read it again after editing the weights."""
        try:
            return to_transformers(self)
        except AttributeError as err:  # nn.Module would report it as "no attribute 'original_model'"
            raise RuntimeError(f"original_model: {err}") from err

    def get_hook_point(self, hook_name: str) -> Optional[HookPoint]:
        """The bridge's `get_hook_point`: the point a name (or alias) names, or None where there is none."""
        try:
            return self.hook_point(hook_name)
        except UnknownNameError:
            return None

    def get_params(self) -> dict[str, torch.Tensor]:
        """The bridge's `get_params` (what its SVDInterpreter reads), which is `tl_parameters()` there and here."""
        return self.tl_parameters()

    def block_hooks(self, layer_idx: int) -> list[str]:
        """The bridge's `block_hooks`: every name a hook in block `layer_idx` answers to, relative to the block, sorted."""
        prefix = f"blocks.{layer_idx}."
        names = [*self.hook_names, *self.hook_aliases]
        return sorted({name[len(prefix):] for name in names if name.startswith(prefix)})

    def blocks_with(self, submodule: str) -> list[tuple[int, Any]]:
        """The bridge's `blocks_with`: (index, block) for the blocks that have `submodule` (`"mlp"`, `"ln1_post"`)."""
        return [(index, block) for index, block in enumerate(self.blocks) if hasattr(block, submodule)]

    def stack_params_for(self, submodule: str, attr_path: str, reshape_fn: Optional[Callable] = None):
        """The bridge's `stack_params_for`: (the layers whose blocks have `submodule`, the weight at `attr_path` in each
        of those blocks, stacked), e.g. `stack_params_for("attn", "attn.W_Q")`; `reshape_fn` maps each weight first."""
        found = self.blocks_with(submodule)
        if not found:
            raise ValueError(f"no block has a submodule {submodule!r}; blocks_with(name) lists the blocks that have one")
        layers, weights = [], []
        for layer, block in found:
            weight = operator.attrgetter(attr_path)(block)
            if weight is None:
                raise AttributeError(f"blocks[{layer}].{attr_path} is None: this checkpoint has no such weight "
                                     f"(a bias-free projection)")
            layers.append(layer)
            weights.append(weight if reshape_fn is None else reshape_fn(weight))
        return layers, torch.stack(weights)

    @property
    def attn_head_labels(self) -> list[str]:
        """The bridge's head labels, "L{layer}H{head}" in layer order (every probe block has attention)."""
        return [f"L{layer}H{head}" for layer in range(self.cfg.n_layers) for head in range(self.cfg.layer_heads(layer))]

    def composition_layer_indices(self) -> list[int]:
        """The bridge's layers with attention, along `all_composition_scores`' layer axes: every layer here."""
        return list(range(self.cfg.n_layers))

    def OV_for_attn_layers(self):
        """The bridge's (layers with attention, their OV circuits): every layer's, `model.OV`."""
        return self.composition_layer_indices(), self.OV

    def QK_for_attn_layers(self):
        """The bridge's (layers with attention, their QK circuits): every layer's, `model.QK`."""
        return self.composition_layer_indices(), self.QK
