"""transformer-lens 4's names on the families whose bridge adapters delegate attention to transformers (Gemma 4's,
AFMoE's, Qwen3-VL's: maintain_native_attention): their q and k norms act before the heads are transposed, so the norms' ends hold
[batch pos head d_head], as probe's hook_q / hook_q_normed do, and their other parts' names (Gemma 4's per-layer
input and experts beside the MLP, AFMoE's output gate and router) map onto probe's points or say where they are.
probe.bridge_names calls delegated_attention_names for each layer of these models."""
from __future__ import annotations

from probe.config import DecoderConfig
from probe.mixture_of_attention_names import mixture_of_attention_names


# the architectures (beside Gemma 4's, known by their layer scalars) whose adapters delegate attention so
# (Qwen2.5-VL's adapter delegates too, but its heads have no q/k norms to name)
DELEGATING = ("AfmoeForCausalLM", "LagunaForCausalLM", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
              "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "NanoChatForCausalLM",
              "JetMoeForCausalLM")


def delegates_attention(cfg: DecoderConfig) -> bool:
    return cfg.layer_scalars or cfg.original_architecture in DELEGATING


def delegated_attention_names(cfg: DecoderConfig, layer: int, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Layer `layer`'s names, added to (or taken from) `aliases` and `left_out`."""
    a = f"blocks.{layer}.attn"
    for part in ("qkv" if cfg.value_norm else "qk") if cfg.qk_norm else ():
        for end, ours in (("hook_in", f"{a}.hook_{part}"), ("hook_out", f"{a}.hook_{part}_normed")):
            left_out.pop(f"{a}.{part}_norm.{end}", None)
            aliases[f"{a}.{part}_norm.{end}"] = ours
    chunked = cfg.chunked_attention
    if chunked is not None and chunked.qk_norm and cfg.layer_rotates(layer):  # (NanoChat's: transposed, then rotated)
        for part in "qk":
            left_out.update(dict.fromkeys((f"{a}.{part}_norm.hook_in", f"{a}.{part}_norm.hook_out"), (
                f"the bridge holds the {part} norm's input and output as [batch head pos d_head]; probe hooks the same "
                f"values as {a}.hook_rot_{part} and {a}.hook_{part}_normed, [batch pos head d_head]")))
    if cfg.layer_scalars:
        gemma4_names(cfg, layer, aliases, left_out)
    elif cfg.original_architecture == "AfmoeForCausalLM":
        afmoe_names(cfg, layer, aliases, left_out)
    elif cfg.original_architecture == "LagunaForCausalLM":  # (its router and shared experts: probe.bridge_names' words)
        output_gate_names(cfg, layer, aliases, left_out)
    elif cfg.mixture_of_attention is not None:
        mixture_of_attention_names(f"blocks.{layer}", aliases, left_out)
    elif cfg.chunked_attention is not None and cfg.layer_sparse(layer):
        llama4_expert_names(f"blocks.{layer}", aliases, left_out)


def afmoe_names(cfg: DecoderConfig, layer: int, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """AFMoE's output gate (`attn.gate`, reading what attention reads) and its router (`mlp.router_gate`)."""
    b = f"blocks.{layer}"
    output_gate_names(cfg, layer, aliases, left_out)
    if cfg.layer_sparse(layer):
        left_out[f"{b}.mlp.router_gate.hook_in"] = (f"the router reads {b}.ln2.hook_out [batch pos d_model] (the "
                                                    f"bridge's holds the tokens flattened, [batch*pos d_model])")
        left_out[f"{b}.mlp.router_gate.hook_out"] = (f"probe hooks the router's sigmoid scores, {b}.mlp.hook_expert_"
                                                     f"weights [batch*pos experts], and the chosen experts, {b}.mlp."
                                                     f"hook_expert_indices, not its logits")


def output_gate_names(cfg: DecoderConfig, layer: int, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """An output gate's projection (`attn.gate`: AFMoE's gate_proj, Laguna's g_proj), reading what attention reads."""
    b, width = f"blocks.{layer}", "1" if cfg.output_gate is not None and cfg.output_gate.per_head else "d_head"
    aliases[f"{b}.attn.gate.hook_in"] = f"{b}.ln1.hook_out"
    left_out[f"{b}.attn.gate.hook_out"] = (f"probe hooks the gate's logits per head, {b}.attn.hook_q_gate [batch pos head "
                                           f"{width}] (the bridge's are [batch pos (head {width})])")


def llama4_expert_names(b: str, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Llama 4's MoE layer: its router and shared expert, whose modules (as probe's) read the tokens flattened,
    [batch*pos ...]; the shared expert's inner points are probe's, its input and output are not hooked apart."""
    s = f"{b}.mlp.shared_expert"
    aliases.update({f"{s}.gate.hook_out": f"{s}.hook_pre", f"{s}.in.hook_out": f"{s}.hook_pre_linear",
                    f"{s}.out.hook_in": f"{s}.hook_post"})
    reads = (f"the router and the shared expert read {b}.ln2.hook_out [batch pos d_model] (the bridge's holds the "
             f"tokens flattened, [batch*pos d_model])")
    left_out.update(dict.fromkeys((f"{b}.mlp.router.hook_in", f"{s}.hook_in", f"{s}.gate.hook_in", f"{s}.in.hook_in"),
                                  reads))
    left_out.update(dict.fromkeys((f"{s}.hook_out", f"{s}.out.hook_out"), (
        f"probe does not hook the shared expert's write apart: {b}.hook_mlp_out holds it with the routed experts' "
        f"(each one's own points: {b}.mlp.experts.E.hook_post, what its W_out reads)")))
    routing = (f"probe hooks the sigmoid of every router logit, {b}.mlp.hook_expert_weights [batch*pos experts] "
               f"(float32; the bridge's router.hook_out keeps the chosen ones' alone, zeros elsewhere, and "
               f"hook_router_scores the logits), and the chosen experts, {b}.mlp.hook_expert_indices")
    left_out.update(dict.fromkeys((f"{b}.mlp.router.hook_out", f"{b}.mlp.hook_router_scores"), routing))


def gemma4_names(cfg: DecoderConfig, layer: int, aliases: dict[str, str], left_out: dict[str, str]) -> None:
    """Gemma 4's block: no k or v where the layer reuses an earlier one's, no v projection where its values are its
    keys; the experts beside the MLP and the per-layer input's modules under the bridge's names."""
    b, a = f"blocks.{layer}", f"blocks.{layer}.attn"
    if cfg.layer_kv_source(layer) is not None:  # no keys or values of its own
        for part in "kv":
            for name in (f"{a}.{part}.hook_out", f"{a}.{part}_norm.hook_in", f"{a}.{part}_norm.hook_out",
                         f"{a}.hook_{part}_input"):
                del aliases[name]
    elif cfg.layer_values_from_keys(layer):  # no value projection: its norm reads the keys' projection
        del aliases[f"{a}.v.hook_out"], aliases[f"{a}.hook_v_input"]
    if cfg.layer_sparse(layer):
        dense = f"{b}.post_feedforward_layernorm_1.hook_in"  # the dense MLP's output, before its own norm
        aliases.update({f"{b}.mlp.hook_out": dense, f"{b}.mlp.out.hook_out": dense,
                        f"{b}.router.hook_out": f"{b}.experts.hook_expert_weights"})
        flat = (f"the bridge holds it flattened, [batch*pos d_model]; probe's is {{}} [batch pos d_model] (the "
                f"router reads {b}.hook_mlp_in's residual, the experts {b}.pre_feedforward_layernorm_2.hook_out)")
        left_out.update({f"{b}.router.hook_in": flat.format(f"{b}.hook_mlp_in"),
                         f"{b}.experts.hook_in": flat.format(f"{b}.pre_feedforward_layernorm_2.hook_out"),
                         f"{b}.experts.hook_out": flat.format(f"{b}.post_feedforward_layernorm_2.hook_in")})
    if cfg.per_layer_inputs is not None:
        p = f"{b}.per_layer"
        aliases.update({f"{b}.per_layer_input_gate.hook_in": f"{p}.hook_in",
                        f"{b}.per_layer_input_gate.hook_out": f"{p}.hook_gate",
                        f"{b}.per_layer_projection.hook_in": f"{p}.hook_gated",
                        f"{b}.per_layer_projection.hook_out": f"{p}.ln.hook_in",
                        f"{b}.post_per_layer_input_norm.hook_in": f"{p}.ln.hook_in",
                        f"{b}.post_per_layer_input_norm.hook_out": f"{p}.ln.hook_out"})
