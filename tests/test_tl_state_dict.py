"""probe/tl_state_dict.py: `state_dict()` in transformer-lens's layout, and `load_state_dict` of it.

The oracles: transformer-lens 3's HookedTransformer itself (in the SAELens virtualenv, tests/saelens_oracle.py's
tl_state_dict command): the names and shapes of its state dict, its own converter's weights for the same
checkpoint, and its forward on what probe exports; `transformers`' forward; and modules written here from the weights
by hand, as ARENA's transformer-from-scratch has students write them, loaded from probe's modules by state dict."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from probe import DEFAULT_MODEL, HookedDecoder, HookedTransformerConfig
from probe.tl_state_dict import TL_BUFFERS, TL_UNWRITTEN
from saelens_oracle import toy_idioms
from test_sae_training import needs_saelens, oracle
from test_variants import build


def tl_config(kind: str, hf) -> dict:
    """HookedTransformerConfig's settings for a transformers model, as a TL user writes them by hand."""
    c = hf.config
    if kind == "gpt2":
        return dict(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head,
                    n_heads=c.n_head, d_mlp=c.n_inner or 4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new",
                    normalization_type="LN", eps=c.layer_norm_epsilon)
    if kind == "neo":  # TL's own GPT-Neo settings (convert_hf_model_config): no q.k scale, local layers
        return dict(n_layers=c.num_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings,
                    d_head=c.hidden_size // c.num_heads, n_heads=c.num_heads, d_mlp=4 * c.hidden_size,
                    d_vocab=c.vocab_size, act_fn=c.activation_function, normalization_type="LN", eps=c.layer_norm_epsilon,
                    use_attn_scale=False, use_local_attn=True, window_size=c.window_size, attn_types=c.attention_layers,
                    original_architecture="GPTNeoForCausalLM")
    if kind == "opt":
        return dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings,
                    d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads, d_mlp=c.ffn_dim,
                    d_vocab=c.vocab_size, act_fn=c.activation_function, normalization_type="LN", eps=1e-5,
                    original_architecture="OPTForCausalLM")
    if kind == "gptj":  # TL's own GPT-J settings (convert_hf_model_config)
        return dict(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head,
                    n_heads=c.n_head, d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn=c.activation_function,
                    normalization_type="LN", eps=c.layer_norm_epsilon, positional_embedding_type="rotary",
                    rotary_adjacent_pairs=True, rotary_dim=c.rotary_dim, parallel_attn_mlp=True,
                    original_architecture="GPTJForCausalLM")
    if kind == "phi":  # TL's own Phi settings (convert_hf_model_config)
        d_head = c.hidden_size // c.num_attention_heads
        return dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings, d_head=d_head,
                    n_heads=c.num_attention_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size, act_fn=c.hidden_act,
                    normalization_type="LN", eps=c.layer_norm_eps, positional_embedding_type="rotary",
                    rotary_base=c.rope_parameters["rope_theta"], parallel_attn_mlp=True, default_prepend_bos=False,
                    rotary_dim=round(c.rope_parameters["partial_rotary_factor"] * d_head),
                    original_architecture="PhiForCausalLM")
    if kind == "gemma3":  # TL's own Gemma 3 settings (its per-size table in loading_from_pretrained)
        rope = c.rope_parameters
        return dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings, d_head=c.head_dim,
                    n_heads=c.num_attention_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size,
                    act_fn="gelu_pytorch_tanh", normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary",
                    rotary_dim=c.head_dim, rotary_base=rope["full_attention"]["rope_theta"],
                    rotary_base_local=rope["sliding_attention"]["rope_theta"], n_key_value_heads=c.num_key_value_heads,
                    gated_mlp=True, final_rms=True, use_normalization_before_and_after=True, use_qk_norm=True,
                    attn_scale=c.query_pre_attn_scalar ** 0.5, use_local_attn=True, window_size=c.sliding_window,
                    attn_types=["local" if t == "sliding_attention" else "global" for t in c.layer_types],
                    original_architecture="Gemma3ForCausalLM")
    if kind == "bloom":  # TL's own Bloom settings (convert_hf_model_config), at the checkpoint's context
        return dict(n_layers=c.n_layer, d_model=c.hidden_size, n_ctx=c.seq_length, d_head=c.hidden_size // c.n_head,
                    n_heads=c.n_head, d_mlp=4 * c.hidden_size, d_vocab=c.vocab_size, act_fn="gelu_fast",
                    eps=c.layer_norm_epsilon, normalization_type="LN", post_embedding_ln=True,
                    positional_embedding_type="alibi", default_prepend_bos=False,
                    original_architecture="BloomForCausalLM")
    if kind in ("mixtral", "olmoe"):  # TL's own settings (convert_hf_model_config), in float32
        d_head = c.hidden_size // c.num_attention_heads
        return dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings, d_head=d_head,
                    n_heads=c.num_attention_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size, act_fn=c.hidden_act,
                    normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary", rotary_dim=d_head,
                    rotary_base=c.rope_parameters["rope_theta"], gated_mlp=True,
                    n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
                    final_rms=True, num_experts=c.num_local_experts if kind == "mixtral" else c.num_experts,
                    experts_per_token=c.num_experts_per_tok, norm_topk_prob=kind == "mixtral" or c.norm_topk_prob,
                    original_architecture=c.architectures[0])
    if kind == "gpt_oss":  # TL's own settings (convert_hf_model_config), in float32
        return dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings,
                    d_head=c.head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size,
                    act_fn=c.hidden_act, normalization_type="RMS", eps=c.rms_norm_eps,
                    positional_embedding_type="rotary", rotary_dim=c.head_dim, rotary_base=c.rope_parameters["rope_theta"],
                    n_key_value_heads=c.num_key_value_heads, gated_mlp=True, final_rms=True,
                    num_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok, use_attention_sinks=True,
                    use_local_attn=True, window_size=c.sliding_window,
                    attn_types=["local" if t == "sliding_attention" else "global" for t in c.layer_types],
                    original_architecture="GptOssForCausalLM")
    d_head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    common = dict(n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings, d_head=d_head,
                  n_heads=c.num_attention_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size,
                  positional_embedding_type="rotary", rotary_adjacent_pairs=False,
                  rotary_base=c.rope_parameters["rope_theta"], original_architecture=c.architectures[0])
    if kind in ("llama", "qwen3", "gemma", "phi3"):
        return dict(common, act_fn="gelu_pytorch_tanh" if kind == "gemma" else "silu", normalization_type="RMS",
                    eps=c.rms_norm_eps, rotary_dim=d_head, gated_mlp=True,
                    # None when every head has its own keys and values, as TL's convert_hf_model_config says it
                    n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
                    final_rms=True, use_qk_norm=kind == "qwen3")
    assert kind == "neox"
    return dict(common, act_fn=c.hidden_act, normalization_type="LN", eps=c.layer_norm_eps, parallel_attn_mlp=True,
                rotary_dim=int(d_head * c.rope_parameters["partial_rotary_factor"]))


def checkpoint(case: str, directory):
    """(the checkpoint's directory, TL's converter kind, the transformers model)."""
    import transformers

    if case == "gpt2-bundled":
        return DEFAULT_MODEL, "gpt2", transformers.GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).eval()
    kind = {"llama-gqa-untied": "llama", "neox-parallel-partial-rotary": "neox", "qwen3-qk-norm-tied": "qwen3",
            "gptneo-local-unscaled": "neo", "opt-pre-norm-tied": "opt", "phi-parallel-shared-norm": "phi",
            "phi3-fused-projections": "phi3", "gptj-adjacent-pairs-partial": "gptj", "bloom-alibi": "bloom",
            "mixtral-experts": "mixtral", "olmoe-experts": "olmoe", "gpt-oss-experts-sinks": "gpt_oss"}[case]
    grouped = {"num_key_value_heads": 2} if kind == "olmoe" else {}  # TL's OLMoE converter asks for grouped heads
    # TL's GPT-OSS has TL's fixed clamp (7) and its plain rope (these settings: its YaRN reads factor from elsewhere)
    plain = dict(swiglu_limit=7.0, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}) if kind == "gpt_oss" else {}
    return directory, kind, build({"neo": "gptneo"}.get(kind, kind), directory, **grouped, **plain)


@needs_saelens
@pytest.mark.parametrize("case", ["gpt2-bundled", "llama-gqa-untied", "neox-parallel-partial-rotary", "qwen3-qk-norm-tied",
                                  "gptneo-local-unscaled", "opt-pre-norm-tied", "phi-parallel-shared-norm",
                                  "phi3-fused-projections", "gptj-adjacent-pairs-partial", "bloom-alibi",
                                  "mixtral-experts", "olmoe-experts", "gpt-oss-experts-sinks"])
def test_the_state_dict_is_hooked_transformers_and_loads_both_ways(case, tmp_path):
    directory, kind, hf = checkpoint(case, tmp_path / "checkpoint")
    model = HookedDecoder.from_pretrained(directory).eval()
    exported = model.state_dict()
    save_file(exported, str(tmp_path / "state.safetensors"))  # contiguous and unshared, as safetensors needs
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    report = json.loads(oracle("tl_state_dict", kind, directory, json.dumps(tl_config(kind, hf)),
                               tmp_path / "state.safetensors", tmp_path / "tokens.safetensors", tmp_path / "out.safetensors"))
    out = load_file(str(tmp_path / "out.safetensors"))
    with torch.no_grad():
        expected = hf(tokens).logits

    # names and shapes: a HookedTransformer's, less the buffers it recomputes from its config
    tl_shapes = {key: shape for key, shape in report["shapes"].items() if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    assert {key: list(t.shape) for key, t in exported.items()} == tl_shapes
    # values: TL's own converter's, for the same checkpoint
    tl_weights = {key.removeprefix("tl."): t for key, t in out.items() if key.startswith("tl.")}
    # TL's Phi-3 converter also writes RMS norms' biases, which its own model lacks and skips (strict=False)
    ignored = {key for key in tl_weights if key not in report["shapes"]}
    assert all(not tl_weights[key].any() for key in ignored) and (kind == "phi3" or not ignored)
    tl_weights = {key: t for key, t in tl_weights.items() if key not in ignored}
    assert set(tl_weights) <= set(exported)
    weights = {key: value for key, value in exported.items() if key.rsplit(".", 1)[-1] not in TL_BUFFERS}
    for key, value in weights.items():  # a bias the converter leaves out stays at TL's zero initialisation
        torch.testing.assert_close(value, tl_weights.get(key, torch.zeros_like(value)), atol=1e-6, rtol=0, msg=key)
    torch.testing.assert_close(out["tl_logits"], expected, atol=1e-4, rtol=1e-4)  # the oracle's own check
    # TL's forward on what probe exports
    assert report["unexpected"] == [] and all(key.rsplit(".", 1)[-1] in TL_BUFFERS for key in report["missing"])
    torch.testing.assert_close(out["logits"], expected, atol=1e-4, rtol=1e-4)
    # and back: a HookedTransformer's state dict (with its buffers) loads strictly into a fresh probe model
    fresh = HookedDecoder(model.cfg).eval()
    # (IGNORE as TL holds it: what a hidden key's score reads)
    buffers = {f"blocks.{l}.attn.{name}": torch.tensor(-math.inf if name == "IGNORE" else 0.0)
               for l in range(model.cfg.n_layers) for name in TL_BUFFERS}
    fresh.load_state_dict({**tl_weights, **buffers}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), expected, atol=1e-4, rtol=1e-4)


# ---- ARENA's transformer from scratch: modules in TL's layout, loaded from probe's by state dict -----------------


class LayerNorm(nn.Module):
    def __init__(self, d_model, eps):
        super().__init__()
        self.w, self.b, self.eps = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.zeros(d_model)), eps

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * self.w + self.b


class Embed(nn.Module):
    def __init__(self, d_vocab, d_model):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(d_vocab, d_model))

    def forward(self, tokens):
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    def __init__(self, n_ctx, d_model):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(n_ctx, d_model))

    def forward(self, tokens):
        return self.W_pos[: tokens.shape[1]].expand(tokens.shape[0], -1, -1)


class Attention(nn.Module):
    def __init__(self, n_heads, d_model, d_head):
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.empty(n_heads, d_model, d_head)) for _ in range(3))
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(torch.zeros(n_heads, d_head)) for _ in range(3))
        self.W_O, self.b_O = nn.Parameter(torch.empty(n_heads, d_head, d_model)), nn.Parameter(torch.zeros(d_model))
        self.register_buffer("IGNORE", torch.tensor(float("-inf")))  # students keep one; probe has no such buffer

    def forward(self, x):
        q, k, v = (torch.einsum("bpm,hmd->bphd", x, w) + b
                   for w, b in ((self.W_Q, self.b_Q), (self.W_K, self.b_K), (self.W_V, self.b_V)))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        n = x.shape[1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), self.IGNORE)
        z = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class MLP(nn.Module):
    def __init__(self, d_model, d_mlp):
        super().__init__()
        self.W_in, self.b_in = nn.Parameter(torch.empty(d_model, d_mlp)), nn.Parameter(torch.zeros(d_mlp))
        self.W_out, self.b_out = nn.Parameter(torch.empty(d_mlp, d_model)), nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        return nn.functional.gelu(x @ self.W_in + self.b_in, approximate="tanh") @ self.W_out + self.b_out


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2 = LayerNorm(cfg.d_model, cfg.eps), LayerNorm(cfg.d_model, cfg.eps)
        self.attn, self.mlp = Attention(cfg.n_heads, cfg.d_model, cfg.d_head), MLP(cfg.d_model, cfg.d_mlp)

    def forward(self, resid):
        resid = resid + self.attn(self.ln1(resid))
        return resid + self.mlp(self.ln2(resid))


class Unembed(nn.Module):
    def __init__(self, d_model, d_vocab):
        super().__init__()
        self.W_U, self.b_U = nn.Parameter(torch.empty(d_model, d_vocab)), nn.Parameter(torch.zeros(d_vocab))

    def forward(self, x):
        return x @ self.W_U + self.b_U


class DemoTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed, self.pos_embed = Embed(cfg.d_vocab, cfg.d_model), PosEmbed(cfg.n_ctx, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_final, self.unembed = LayerNorm(cfg.d_model, cfg.eps), Unembed(cfg.d_model, cfg.d_vocab)

    def forward(self, tokens):
        resid = self.embed(tokens) + self.pos_embed(tokens)
        for block in self.blocks:
            resid = block(resid)
        return self.unembed(self.ln_final(resid))


def test_arena_modules_load_from_probe_by_state_dict_and_agree():
    """ARENA 1.1's `load_gpt2_test(cls, reference_gpt2.<module>, input)` and `demo_gpt2.load_state_dict(
    reference_gpt2.state_dict(), strict=False)`, with probe as the reference: every module a student writes in TL's
    layout gets all its weights and gives the reference module's output, and the whole model gives transformers'."""
    import transformers

    reference = HookedDecoder.from_pretrained(DEFAULT_MODEL, fold_ln=False, center_unembed=False,
                                              center_writing_weights=False).eval()
    cfg = reference.cfg
    tokens = reference.to_tokens("ROMEO. But soft, what light through yonder window breaks?")
    _, cache = reference.run_with_cache(tokens)

    def load_gpt2_test(student: nn.Module, reference_module: nn.Module, input):
        loaded = student.load_state_dict(reference_module.state_dict(), strict=False)
        # as from a HookedTransformer's module: TL's attention state dict has a mask buffer ARENA's classes lack
        assert all(key.endswith("mask") for key in loaded.unexpected_keys), loaded
        assert all(key.endswith("IGNORE") for key in loaded.missing_keys), loaded
        with torch.no_grad():
            torch.testing.assert_close(student(input), reference_module(input), atol=1e-4, rtol=1e-3)

    load_gpt2_test(LayerNorm(cfg.d_model, cfg.eps), reference.ln_final, cache["resid_post", cfg.n_layers - 1])
    load_gpt2_test(Embed(cfg.d_vocab, cfg.d_model), reference.embed, tokens)
    load_gpt2_test(PosEmbed(cfg.n_ctx, cfg.d_model), reference.pos_embed, tokens)
    load_gpt2_test(Attention(cfg.n_heads, cfg.d_model, cfg.d_head), reference.blocks[0].attn, cache["normalized", 0, "ln1"])
    load_gpt2_test(MLP(cfg.d_model, cfg.d_mlp), reference.blocks[0].mlp, cache["normalized", 0, "ln2"])
    load_gpt2_test(Block(cfg), reference.blocks[0], cache["resid_pre", 0])
    load_gpt2_test(Unembed(cfg.d_model, cfg.d_vocab), reference.unembed, cache["ln_final.hook_normalized"])

    demo = DemoTransformer(cfg)
    loaded = demo.load_state_dict(reference.state_dict(), strict=False)
    assert all(key.endswith("attn.mask") for key in loaded.unexpected_keys)
    assert all(key.endswith("IGNORE") for key in loaded.missing_keys)
    hf = transformers.GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).eval()
    with torch.no_grad():
        torch.testing.assert_close(demo(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)


# ---- loading probe's own layout, refusals ---------------------------------------------------------------------


def test_probe_layout_state_dicts_still_load(tiny_model, tokens):
    """load_state_dict takes probe's own names too (parameters as named_parameters() names them)."""
    own = {name: p.detach().clone() for name, p in tiny_model.named_parameters(remove_duplicate=False)}
    fresh = HookedDecoder(tiny_model.cfg).eval()
    fresh.load_state_dict(own, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), tiny_model(tokens))


def test_a_module_state_dict_round_trips_and_biases_the_model_lacks_are_zeros(tmp_path):
    hf = build("llama", tmp_path)  # no biases anywhere, grouped key/value heads
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    attn = model.blocks[1].attn
    state = attn.state_dict()
    assert sorted(state) == ["IGNORE", "W_O", "W_Q", "_W_K", "_W_V", "_b_K", "_b_V", "b_O", "b_Q", "mask"]
    assert all(state[name].count_nonzero() == 0 for name in ("b_Q", "_b_K", "_b_V", "b_O"))
    # W_Q[h] is transformers' q_proj rows for head h, transposed (the weights by hand)
    q_proj = hf.model.layers[1].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(state["W_Q"][3], q_proj[3 * 8:4 * 8].T)
    other = HookedDecoder.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        for p in other.blocks[1].attn.parameters():
            p.zero_()
    other.blocks[1].attn.load_state_dict(state, strict=True)
    assert torch.equal(other.blocks[1].attn.qkv.weight, attn.qkv.weight)
    assert torch.equal(other.blocks[1].attn.out.weight, attn.out.weight)


def test_a_nonzero_bias_the_model_has_no_room_for_is_refused_by_name(tmp_path):
    build("llama", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    state = model.state_dict()
    state["blocks.0.attn.b_Q"] = torch.ones_like(state["blocks.0.attn.b_Q"])
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.b_Q is not zero.*qkv_bias"):
        model.load_state_dict(state)
    state = model.state_dict()
    state["blocks.1.mlp.b_out"] = torch.ones_like(state["blocks.1.mlp.b_out"])
    with pytest.raises(RuntimeError, match=r"blocks\.1\.mlp\.b_out is not zero.*mlp_bias"):
        model.load_state_dict(state)


def test_wrong_shapes_and_missing_pieces_are_named(tiny_model):
    state = tiny_model.state_dict()
    state["blocks.0.attn.W_K"] = state["blocks.0.attn.W_K"][:, :, :-1]
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.W_K has shape .* but this model needs"):
        HookedDecoder(tiny_model.cfg).load_state_dict(state)
    # a piece left out: missing under its TL name (strict=True raises, strict=False keeps the model's own)
    state = tiny_model.state_dict()
    del state["blocks.0.attn.W_V"], state["blocks.1.mlp.b_in"], state["unembed.W_U"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.0\.attn\.W_V"'):
        HookedDecoder(tiny_model.cfg).load_state_dict(state)
    fresh = HookedDecoder(tiny_model.cfg)
    before = {name: getattr(fresh.blocks[0].attn, name).detach().clone() for name in ("W_Q", "W_V")}
    loaded = fresh.load_state_dict(state, strict=False)
    assert sorted(loaded.missing_keys) == ["blocks.0.attn.W_V", "blocks.1.mlp.b_in", "unembed.W_U"]
    assert loaded.unexpected_keys == []
    assert torch.equal(fresh.blocks[0].attn.W_V, before["W_V"])  # kept
    assert torch.equal(fresh.blocks[0].attn.W_Q, tiny_model.blocks[0].attn.W_Q)  # loaded
    assert not torch.equal(fresh.blocks[0].attn.W_Q, before["W_Q"])


def test_a_tied_model_refuses_an_unembedding_that_is_not_its_embedding(tmp_path):
    """A processed TL model's W_U is centred, no longer W_E transposed: a tied probe model cannot hold both, and
    without the check the later tensor would silently overwrite the earlier."""
    model = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    assert model.cfg.tied_embeddings
    state = model.state_dict()
    state["unembed.W_U"] = state["unembed.W_U"] - state["unembed.W_U"].mean(-1, keepdim=True)
    with pytest.raises(RuntimeError, match="tied_embeddings=False"):
        HookedDecoder(model.cfg).load_state_dict(state)
    untied = HookedDecoder(dataclasses.replace(model.cfg, tied_embeddings=False))
    untied.load_state_dict(state, strict=True)
    assert torch.equal(untied.unembed.W_U, state["unembed.W_U"])


# ---- HookedTransformerConfig(...) + HookedDecoder(cfg): a HookedTransformer built from scratch, and its weights ----

TOY_CONFIGS = {
    "ln-defaults": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu", seed=1),
    "rms-rotary-gqa-gated": dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_ctx=16, d_vocab=50, act_fn="silu",
                                 normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8,
                                 n_key_value_heads=2, gated_mlp=True, final_rms=True, d_mlp=48),
    "parallel-partial-rotary-scaled": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="relu",
                                           parallel_attn_mlp=True, positional_embedding_type="rotary", rotary_dim=4,
                                           d_mlp=64, attn_scale=3.0, rotary_base=500),
    "local-windows-softcaps": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu_new",
                                   use_local_attn=True, window_size=4, attn_types=["global", "local"],
                                   attn_scores_soft_cap=5.0, output_logits_soft_cap=3.0),
    "lnpre-othello-like": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu",
                               normalization_type="LNPre"),
    "rmspre-rotary": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu",
                          normalization_type="RMSPre", positional_embedding_type="rotary"),
    "no-norm-grokking-like": dict(n_layers=1, d_vocab=114, d_model=32, d_mlp=128, n_heads=4, d_head=8, n_ctx=3,
                                  act_fn="relu", normalization_type=None),
    "grokking-d-vocab-out": dict(n_layers=1, d_vocab=114, d_vocab_out=113, d_model=32, d_mlp=128, n_heads=4,
                                 d_head=8, n_ctx=3, act_fn="relu", normalization_type=None),
    "bidirectional-hook-tokens": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="relu",
                                      attention_dir="bidirectional", use_hook_tokens=True),
    "attn-only-ln": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, attn_only=True),
    # ARENA 1.2's induction model, smaller: attention only, shortformer positions, no norms, no act_fn
    "attn-only-shortformer-arena-like": dict(n_layers=2, d_model=32, d_head=8, n_heads=4, n_ctx=16, d_vocab=50,
                                             attention_dir="causal", attn_only=True, seed=398, use_attn_result=True,
                                             normalization_type=None, positional_embedding_type="shortformer"),
    "attn-only-shortformer-ln": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, attn_only=True,
                                     positional_embedding_type="shortformer"),
    "one-layer-relu-result": dict(n_layers=1, d_model=24, d_head=6, n_ctx=8, d_vocab=30, act_fn="relu",
                                  use_attn_result=True, default_prepend_bos=False, initializer_range=0.05),
}


@needs_saelens
@pytest.mark.parametrize("case", sorted(TOY_CONFIGS))
def test_a_hooked_transformer_built_from_its_config_loads_into_probe_and_agrees(case, tmp_path):
    """TL's `HookedTransformer(HookedTransformerConfig(**settings))` and its trained weights (here moved off their
    initialisation), against probe's `HookedDecoder(probe.HookedTransformerConfig(**settings))` given the same
    state dict: the config resolves TL's defaults as TL does, the state dict loads strictly, the logits agree."""
    settings = TOY_CONFIGS[case]
    tokens = torch.randint(0, settings["d_vocab"], (2, settings["n_ctx"]), generator=torch.Generator().manual_seed(2))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    resolved = json.loads(oracle("tl_build", json.dumps(settings), tmp_path / "tokens.safetensors", tmp_path / "out.safetensors"))
    out = load_file(str(tmp_path / "out.safetensors"))

    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    for name, value in resolved.items():
        assert getattr(model.cfg, name) == pytest.approx(value) if isinstance(value, float) else getattr(model.cfg, name) == value, name
    model.load_state_dict({key.removeprefix("state."): t for key, t in out.items() if key.startswith("state.")}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), out["logits"], atol=1e-4, rtol=1e-4)
    if settings.get("use_attn_result"):  # a cache of everything holds each head's write, as TL's does then
        _, cache = model.run_with_cache(tokens)
        assert "blocks.0.attn.hook_result" in cache


@pytest.mark.parametrize("settings, match", [
    (dict(attn_only=True, parallel_attn_mlp=True), "attn_only=True.*parallel blocks.*pre-norm"),
    (dict(normalization_type="LNx"), "normalization_type='LNx'.*'LN', 'LNPre', 'RMS', 'RMSPre' and None"),
    (dict(positional_embedding_type="xpos"), "xpos.*'standard'.*'shortformer', 'rotary' and 'alibi'"),
    (dict(attention_dir="encoder"), "attention_dir='encoder'.*'causal' or 'bidirectional'"),
    (dict(default_padding_side="left"), "set_tokenizer\\(tokenizer, default_padding_side='left'\\)"),
    (dict(act_fn="tanh"), "act_fn='tanh'.*'solu', 'solu_ln', 'xielu'"),
    (dict(final_rms=True), "final_rms=True.*normalization_type='RMS'"),
    (dict(d_vocab=-1), "needs d_vocab, or tokenizer_name"),
    (dict(n_lyers=2), r"unknown keywords \['n_lyers'\]"),
])
def test_what_probe_does_not_build_is_refused_by_name(settings, match):
    base = dict(n_layers=1, d_model=16, d_head=4, n_ctx=8, d_vocab=20, act_fn="gelu")
    with pytest.raises((TypeError, ValueError), match=match):
        HookedTransformerConfig(**{**base, **settings})


def test_a_config_naming_a_dtype_builds_the_model_in_it():
    model = HookedDecoder(HookedTransformerConfig(n_layers=1, d_model=16, d_head=4, n_ctx=8, d_vocab=20, act_fn="gelu",
                                                  dtype=torch.bfloat16))
    assert model.embed.W_E.dtype == torch.bfloat16 and model.cfg.dtype == torch.bfloat16
    assert model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16


def test_a_gated_mlp_keeps_its_projection_biases_and_refuses_tl_bias_after_the_gate(tmp_path):
    """transformer-lens's gated MLP adds b_in after act(gate) * up; transformers' (and probe's) bias the up and gate
    projections inside the product. The two are different functions, so probe's go under their own names, b_up and
    b_gate, and a non-zero TL b_in is refused rather than put where it would compute something else."""
    hf = build("llama", tmp_path, mlp_bias=True, attention_bias=True, num_key_value_heads=1)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    state = model.state_dict()
    assert state["blocks.0.mlp.b_in"].count_nonzero() == 0
    torch.testing.assert_close(state["blocks.0.mlp.b_up"], hf.model.layers[0].mlp.up_proj.bias.detach())
    torch.testing.assert_close(state["blocks.0.mlp.b_gate"], hf.model.layers[0].mlp.gate_proj.bias.detach())
    fresh = HookedDecoder(model.cfg).eval()
    fresh.load_state_dict(state, strict=True)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    state["blocks.1.mlp.b_in"] = torch.ones_like(state["blocks.1.mlp.b_in"])
    with pytest.raises(RuntimeError, match=r"blocks\.1\.mlp\.b_in is not zero.*after act\(gate\) \* up"):
        fresh.load_state_dict(state)


@needs_saelens
@pytest.mark.parametrize("case, steps", [
    ("ln-defaults", {}),  # TL's defaults: fold, centre the writers and the unembedding, fold the value biases
    ("ln-defaults", {"center_unembed": False, "fold_value_biases": False}),
    ("rms-rotary-gqa-gated", {}),  # centring the writers does not apply to RMSNorm: skipped, as TL skips it
    ("parallel-partial-rotary-scaled", {}),
    ("lnpre-othello-like", {}),
    ("no-norm-grokking-like", {}),  # nothing to fold, no LayerNorm to centre the writers for: both skipped
    ("grokking-d-vocab-out", {}),
    ("attn-only-ln", {}),
    ("attn-only-shortformer-arena-like", {}),  # no norms: nothing to fold or centre, both skipped
])
def test_load_and_process_state_dict_is_hooked_transformers(case, steps, tmp_path):
    """`model.load_and_process_state_dict(state, **steps)` on both libraries, from the same HookedTransformer weights:
    the processed state dicts (TL's layout, no norm weights left), the logits and cfg.normalization_type agree."""
    settings = TOY_CONFIGS[case]
    tokens = torch.randint(0, settings["d_vocab"], (2, settings["n_ctx"]), generator=torch.Generator().manual_seed(4))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    resolved = json.loads(oracle("tl_build", json.dumps(settings), tmp_path / "tokens.safetensors",
                                 tmp_path / "out.safetensors", json.dumps(steps)))
    out = load_file(str(tmp_path / "out.safetensors"))
    raw = {key.removeprefix("state."): t for key, t in out.items() if key.startswith("state.")}
    theirs = {key.removeprefix("processed."): t for key, t in out.items() if key.startswith("processed.")}

    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the defaults an RMSNorm model skips
        model.load_and_process_state_dict(raw, **steps)
    assert model.cfg.normalization_type == resolved["processed_normalization_type"]
    ours = model.state_dict()
    assert set(ours) == {key for key in theirs if key.rsplit(".", 1)[-1] not in TL_UNWRITTEN}
    tl_keys = {key for key in theirs if key.rsplit(".", 1)[-1] not in TL_BUFFERS}  # TL fills its mask as it runs
    for key in tl_keys:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), out["processed_logits"], atol=1e-4, rtol=1e-4)
    # a processed state dict (no norm weights) loads into a fresh, unprocessed model too: fold_ln is skipped
    fresh = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    with pytest.warns(UserWarning, match="skipping fold_ln"):
        fresh.load_and_process_state_dict(theirs, fold_ln=True, center_writing_weights=False, center_unembed=False,
                                          fold_value_biases=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), out["processed_logits"], atol=1e-4, rtol=1e-4)


def test_set_tokenizer_gives_a_model_built_from_its_config_transformers_tokens():
    """TL's `model.set_tokenizer(AutoTokenizer.from_pretrained(...))` on a model built from its config: the model then
    tokenizes as the transformers tokenizer does (BOS first), pads on the side asked for, and decodes back."""
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = HookedDecoder(HookedTransformerConfig(n_layers=1, d_model=16, d_head=4, n_ctx=64,
                                                  d_vocab=len(hf_tokenizer), act_fn="gelu"))
    assert model.tokenizer is None
    model.set_tokenizer(hf_tokenizer, default_padding_side="left")
    text = "ROMEO. But soft, what light"
    expected = [hf_tokenizer.bos_token_id] + hf_tokenizer(text)["input_ids"]
    assert model.to_tokens(text)[0].tolist() == expected
    assert model.to_str_tokens(text) == [hf_tokenizer.decode([i]) for i in expected]
    assert model.to_string(model.to_tokens(text)[0, 1:]) == text
    short = [hf_tokenizer.bos_token_id] + hf_tokenizer("ROMEO.")["input_ids"]
    batch = model.to_tokens([text, "ROMEO."])
    assert batch[1, -len(short):].tolist() == short  # left-padded
    assert batch[1, :len(expected) - len(short)].eq(hf_tokenizer.eos_token_id).all()  # GPT-2 pads with EOS, as TL does
    # the same from TL's constructor, HookedTransformer(cfg, tokenizer, move_to_device=, default_padding_side=)
    built = HookedDecoder(HookedTransformerConfig(n_layers=1, d_model=16, d_head=4, n_ctx=64, d_vocab=len(hf_tokenizer),
                                                  act_fn="gelu"), hf_tokenizer, move_to_device=False,
                          default_padding_side="left")
    assert torch.equal(built.to_tokens([text, "ROMEO."]), batch)
    with torch.no_grad():
        assert model(text).shape == (1, len(expected), len(hf_tokenizer))


def test_a_model_without_norms_decomposes_into_its_logits():
    """normalization_type=None (grokking's model): the norms are the identity, with scale 1, so the cache's
    decomposition with the norm "applied" still adds up to the logits, and the accumulated residual ends at them."""
    model = HookedDecoder(HookedTransformerConfig(n_layers=2, d_vocab=40, d_model=32, d_mlp=64, n_heads=4, d_head=8,
                                                  n_ctx=8, act_fn="relu", normalization_type=None, seed=0)).eval()
    assert model.cfg.normalization_type is None and model.state_dict().keys().isdisjoint({"blocks.0.ln1.w", "ln_final.w"})
    tokens = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    logits, cache = model.run_with_cache(tokens)
    by_hand = cache["embed"] + cache["pos_embed"]
    for l in range(2):
        by_hand = by_hand + cache["attn_out", l] + cache["mlp_out", l]
    torch.testing.assert_close(by_hand @ model.W_U + model.b_U, logits, atol=1e-5, rtol=1e-5)
    stack = cache.decompose_resid(apply_ln=True, pos_slice=-1)
    torch.testing.assert_close(stack.sum(0) @ model.W_U + model.b_U, logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.accumulated_resid(apply_ln=True, pos_slice=-1)[-1] @ model.W_U + model.b_U,
                               logits[:, -1], atol=1e-5, rtol=1e-5)


def test_w_gate_and_n_params_total_are_transformers_weights_and_count(tmp_path):
    hf = build("llama", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    expected = torch.stack([layer.mlp.gate_proj.weight.detach().T for layer in hf.model.layers])
    torch.testing.assert_close(model.W_gate, expected)
    assert model.n_params_total == hf.num_parameters()
    gpt2 = HookedDecoder.from_pretrained(DEFAULT_MODEL)
    assert gpt2.W_gate is None  # no gated MLP, as transformer-lens says
    import transformers
    assert gpt2.n_params_total == transformers.GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).num_parameters()


def test_a_model_predicting_fewer_tokens_than_it_reads_checks_answers_against_its_logits(tmp_path):
    """d_vocab_out < d_vocab (grokking's original model reads an "=" token it never predicts): the logits have
    d_vocab_out columns, an answer outside them is refused by name, and no Hugging Face format holds the model."""
    from probe import DecoderConfig, HookedTransformerConfig
    from probe.analyses import direct_logit_attribution

    model = HookedDecoder(HookedTransformerConfig(n_layers=1, d_vocab=12, d_vocab_out=11, d_model=16, d_head=4,
                                                  n_ctx=3, act_fn="relu", normalization_type=None, seed=0)).eval()
    tokens = torch.tensor([[3, 5, 11]])  # 11 is "=": an input only
    assert model(tokens).shape == (1, 3, 11) and model.W_U.shape == (16, 11)
    assert model.ledger().total_params == sum(p.numel() for p in model.parameters())
    direct_logit_attribution(model, tokens, 8, 2)  # answers the logits hold
    with pytest.raises(ValueError, match=r"answer token id 11 is outside the vocabulary the logits cover \[0, 11\)"):
        direct_logit_attribution(model, tokens, 11, 2)
    with pytest.raises(ValueError, match="d_vocab_out=11, d_vocab=12"):
        model.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="tied_embeddings=False"):
        DecoderConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=12, d_vocab_out=11, n_ctx=4)


def built_by_hooked_transformer(settings: dict, tokens: torch.Tensor, tmp_path) -> dict:
    """The state dict of HookedTransformer(HookedTransformerConfig(**settings)), its weights moved off their
    initialisation (the oracle's tl_build); also written to tmp_path: tokens.safetensors and state.safetensors."""
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    oracle("tl_build", json.dumps(settings), tmp_path / "tokens.safetensors", tmp_path / "built.safetensors")
    state = {key.removeprefix("state."): t for key, t in load_file(str(tmp_path / "built.safetensors")).items()
             if key.startswith("state.")}
    save_file(state, str(tmp_path / "state.safetensors"))
    return state


@needs_saelens
@pytest.mark.parametrize("case", ["ln-defaults", "lnpre-othello-like", "no-norm-grokking-like", "rms-rotary-gqa-gated"])
def test_toy_model_analyses_written_for_hooked_transformer_agree(case, tmp_path):
    """The analyses ARENA's grokking and Othello-GPT sections write (caches, neuron maps, OV/QK, decompositions, a
    head ablation, the loss), one function run on HookedTransformer and on probe, each built from the same config
    and given the same trained weights (tests/saelens_oracle.py: toy_idioms)."""
    toy_idioms_on_both(TOY_CONFIGS[case], tmp_path)


def toy_idioms_on_both(settings: dict, tmp_path, edit=lambda state: None):
    """toy_idioms on HookedTransformer and on probe, both given HookedTransformer's trained-looking weights (after
    `edit(state)`), their results compared to 1e-4: (probe's model, its results, TL's)."""
    tokens = torch.randint(0, settings["d_vocab"], (2, settings["n_ctx"]), generator=torch.Generator().manual_seed(6))
    state = built_by_hooked_transformer(settings, tokens, tmp_path)
    edit(state)
    save_file(state, str(tmp_path / "state.safetensors"))
    oracle("toy_idioms", json.dumps(settings), tmp_path / "state.safetensors", tmp_path / "tokens.safetensors",
           tmp_path / "theirs.safetensors")
    theirs = load_file(str(tmp_path / "theirs.safetensors"))
    model = HookedDecoder(HookedTransformerConfig(**settings)).eval()
    model.load_state_dict(state, strict=True)
    ours = toy_idioms(model, tokens)
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value.float(), theirs[name].float(), atol=1e-4, rtol=1e-4, msg=name)
    return model, ours, theirs


@needs_saelens
def test_a_state_dict_saved_by_an_older_transformer_lens_masks_scores_with_its_ignore(tmp_path):
    # ARENA's monthly problems ship checkpoints whose IGNORE is -1e5: HookedTransformer's cached attn_scores hold it
    def older(state):
        state.update({key: torch.tensor(-1e5) for key in state if key.endswith(".IGNORE")})

    model, ours, theirs = toy_idioms_on_both(TOY_CONFIGS["ln-defaults"], tmp_path, older)
    assert theirs["attn_scores0"].min() == -1e5 and ours["attn_scores0"].min() == -1e5
    assert model.state_dict()["blocks.1.attn.IGNORE"].item() == -1e5  # saved as loaded


def test_arena_grokking_loader_edits_ignore_in_the_state_dict_and_loads_it(tiny_model, tokens):
    # ARENA 1.5's load_in_state_dict starts from model.state_dict(), sets each attention's IGNORE and loads it back:
    # the buffers are there as in a HookedTransformer's state dict (an empty mask, IGNORE -inf), and change nothing
    state = tiny_model.state_dict()
    assert state["blocks.0.attn.IGNORE"].item() == float("-inf") and state["blocks.0.attn.mask"].shape == (0, 0)
    state["blocks.0.attn.IGNORE"] = torch.full_like(state["blocks.0.attn.IGNORE"], -1e10)
    fresh = HookedDecoder(tiny_model.cfg).eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), tiny_model(tokens))
