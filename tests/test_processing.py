"""probe.processing: weight processing keeps what the model computes (transformers' log-probabilities
as the oracle) and changes the activations exactly as the algebra says (relations derived by hand)."""
from __future__ import annotations

import pytest
import torch

from probe import DecoderConfig, HookedDecoder
from probe.processing import process_weights

ATOL = 1e-4


def log_probs(model, tokens):
    with torch.no_grad():
        return model(tokens).float().log_softmax(-1)


def test_processed_gpt2_gives_transformers_log_probs_and_leaves_the_original(tiny_model, tiny_hf, tokens):
    before = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    processed = process_weights(tiny_model)
    with torch.no_grad():
        expected = tiny_hf(tokens).logits.log_softmax(-1)
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    assert all(torch.equal(p, before[name]) for name, p in tiny_model.named_parameters())
    assert tiny_model.cfg.tied_embeddings and tiny_model.unembed.weight is tiny_model.embed.W_E
    assert not processed.cfg.tied_embeddings and processed.cfg.unembed_bias  # GPT-2's ln_f bias now lives there


def test_activations_change_as_the_algebra_says(tiny_model, tokens):
    """Centring the writers removes each residual's mean over d_model; folding keeps every norm's
    normalised output, queries, keys and pattern; folding value biases takes b_V out of v and z."""
    processed = process_weights(tiny_model)
    _, old = tiny_model.run_with_cache(tokens)
    _, new = processed.run_with_cache(tokens)
    for name in old:
        if name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post")):
            expected = old[name] - old[name].mean(-1, keepdim=True)
        elif name.endswith(("hook_v", "hook_z")):
            layer = int(name.split(".")[1])
            block = tiny_model.blocks[layer]
            v_rows = slice(2 * block.attn.n_heads * block.attn.d_head, None)
            # v's constant part: its own bias plus ln1's bias read through W_V (folded into it first)
            b_v = block.attn.qkv.bias[v_rows] + block.attn.qkv.weight[v_rows] @ block.ln1.b
            expected = old[name] - b_v.view(block.attn.n_heads, block.attn.d_head)  # pattern rows sum to 1: z carries it too
        elif name.endswith(("hook_normalized", "hook_scale", "hook_q", "hook_k", "hook_attn_scores", "hook_pattern",
                            "hook_pre", "hook_post")):
            expected = old[name]
        elif name == "unembed.hook_in":  # ln_final's w and b now live in the unembedding: it reads the normalised input
            expected = old["ln_final.hook_normalized"]
        elif name == "unembed.hook_out":  # centred unembedding: logits less their mean over the vocabulary
            expected = old[name] - old[name].mean(-1, keepdim=True)
        else:  # embeddings and sublayer outputs: centred writers
            expected = old[name] - old[name].mean(-1, keepdim=True)
        torch.testing.assert_close(new[name], expected, atol=ATOL, rtol=0, msg=lambda s: f"{name}: {s}")


def test_processed_weights_have_the_promised_form(tiny_model):
    processed = process_weights(tiny_model)
    zero = lambda t: torch.testing.assert_close(t, torch.zeros_like(t), atol=1e-6, rtol=0)  # noqa: E731
    for norm in [processed.ln_final] + [b.ln1 for b in processed.blocks] + [b.ln2 for b in processed.blocks]:
        assert torch.equal(norm.w, torch.ones_like(norm.w)) and torch.equal(norm.b, torch.zeros_like(norm.b))
    zero(processed.embed.W_E.mean(-1))
    zero(processed.pos_embed.W_pos.mean(-1))
    for block in processed.blocks:
        zero(block.attn.W_O.mean(-1))
        zero(block.mlp.W_out.mean(-1))
        zero(block.attn.qkv.bias[2 * block.attn.n_heads * block.attn.d_head:])  # b_V
    zero(processed.unembed.W_U.mean(-1))  # each logit's mean over the vocabulary


def test_each_step_alone_keeps_the_log_probs(tiny_model, tokens):
    expected = log_probs(tiny_model, tokens)
    steps = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    for step in steps:
        only = process_weights(tiny_model, **{s: s == step for s in steps})
        torch.testing.assert_close(log_probs(only, tokens), expected, atol=ATOL, rtol=0, msg=lambda s: f"{step}: {s}")


def test_layers_without_biases_get_the_folded_norm_bias():
    """A LayerNorm model without any linear bias (and a pruned layer without heads): folding a norm's
    bias needs a bias in the layer that reads it, so one is added."""
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, qkv_bias=False, out_bias=False,
                        mlp_bias=False, heads_per_layer=(3, 0))
    torch.manual_seed(0)
    model = HookedDecoder(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith(".w") else 0.0))
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    processed = process_weights(model)
    torch.testing.assert_close(log_probs(processed, tokens), log_probs(model, tokens), atol=ATOL, rtol=0)
    assert processed.cfg.qkv_bias and processed.cfg.mlp_bias and not model.cfg.qkv_bias


def test_rms_models_fold_but_cannot_centre(tmp_path):
    """Llama's RMSNorm does not subtract the mean, so centring would change its outputs."""
    from test_variants import build

    hf = build("llama", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="center_writing_weights=False"):
        process_weights(model)
    processed = process_weights(model, center_writing_weights=False)
    with torch.no_grad():
        expected = hf(tokens).logits.log_softmax(-1)
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    assert all(torch.equal(b.ln1.w, torch.ones_like(b.ln1.w)) for b in processed.blocks)


def test_parallel_blocks_process_like_transformers(tmp_path):
    """GPT-NeoX (Pythia): both norms read resid_pre; each folds into the layer that reads it."""
    from test_variants import build

    hf = build("neox", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    processed = process_weights(model)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits.log_softmax(-1)
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    _, cache = processed.run_with_cache(tokens, names=lambda n: n.endswith("hook_resid_post"))
    for name, resid in cache.items():  # every writer centred: the residual has no mean left
        torch.testing.assert_close(resid.mean(-1), torch.zeros_like(resid.mean(-1)), atol=1e-5, rtol=0)
    assert all(torch.equal(b.ln2.w, torch.ones_like(b.ln2.w)) and not b.ln2.b.any() for b in processed.blocks)


@pytest.mark.parametrize("kind, overrides", [("gptneo", {}), ("opt", {}), ("olmo", {}), ("olmo2", {}),
                                             ("opt", {"layer_norm_elementwise_affine": False, "enable_bias": False})])
def test_gpt_neo_opt_and_olmo_process_like_transformers(kind, overrides, tmp_path):
    """TL's default processing (fold_ln, centring, fold_value_biases) on GPT-Neo's unscaled, windowed attention,
    OPT's layout (with and without affine norms and biases) and OLMo's weightless norms keeps transformers'
    log-probabilities; on OLMo 2 (RMS write norms, nothing to centre) fold_ln and fold_value_biases do."""
    from test_variants import build

    hf = build(kind, tmp_path, **overrides)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    processed = process_weights(model, center_writing_weights=False) if kind == "olmo2" else process_weights(model)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits.log_softmax(-1)
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    assert not processed.cfg.norm_weights


def test_post_norm_models_are_refused(tmp_path):
    from test_variants import build

    build("gpt1", tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pre-norm"):
        process_weights(model)


def test_a_processed_model_says_why_it_cannot_be_saved(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="unembedding bias"):
        process_weights(tiny_model).save_pretrained(tmp_path / "processed")
    assert not (tmp_path / "processed").exists()


def randomised(cfg, seed=0):
    """A model with every norm and bias random too, so each fold moves something."""
    torch.manual_seed(seed)
    model = HookedDecoder(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".b", ".bias")):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def test_a_config_that_gains_biases_describes_every_layer():
    """Folding gives some layers a bias; the config then says every such layer has one, so a model rebuilt
    from it (as pruning and state-dict loading do) must take the processed weights as they are."""
    cfg = DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, qkv_bias=False, out_bias=False,
                        mlp_bias=False, heads_per_layer=(3, 0))
    model = randomised(cfg)
    with torch.no_grad():
        model.blocks[1].ln1.b.zero_()  # nothing to fold into layer 1's qkv
    processed = process_weights(model)
    rebuilt = HookedDecoder(processed.cfg).eval()
    rebuilt.load_state_dict(processed.state_dict(), strict=True)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(log_probs(rebuilt, tokens), log_probs(model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", [
    dict(n_kv_heads=2, tied_embeddings=False),  # grouped-query, every bias
    dict(n_kv_heads=1, gated_mlp=True, activation="silu", positions="rotary", mlp_bias=False),  # multi-query, gated
])
def test_grouped_query_models_keep_their_log_probs(variant):
    model = randomised(DecoderConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, **variant), seed=3)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    processed = process_weights(model)
    torch.testing.assert_close(log_probs(processed, tokens), log_probs(model, tokens), atol=ATOL, rtol=0)
    for block in processed.blocks:  # each kv head's value bias went into b_O, through every query head it serves
        attn = block.attn
        b_v = attn.qkv.bias[(attn.n_heads + attn.n_kv_heads) * attn.d_head:]
        assert b_v.numel() == attn.n_kv_heads * attn.d_head and not b_v.any()


def test_processing_inside_a_hooks_block_gives_a_model_without_those_hooks(tiny_model, tokens):
    calls = []
    with tiny_model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: calls.append(1) or x * 0)]):
        processed = process_weights(tiny_model)
    expected = log_probs(tiny_model, tokens)  # outside the block: the unhooked model
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    assert calls == []


@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_gemma_norms_fold_and_keep_transformers_log_probs(kind, tmp_path):
    """Gemma (RMS, scaled embeddings) folds its norms; Gemma 2 folds the norms before each sublayer and keeps
    the write norms. Neither can centre (RMSNorm), and Gemma 2's logit cap does not pass a shift through."""
    from test_variants import build

    hf = build(kind, tmp_path)
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    processed = process_weights(model, center_writing_weights=False, center_unembed=kind == "gemma")
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits.log_softmax(-1)
    torch.testing.assert_close(log_probs(processed, tokens), expected, atol=ATOL, rtol=0)
    for block, original in zip(processed.blocks, model.blocks):
        assert torch.equal(block.ln1.w, torch.ones_like(block.ln1.w)) and torch.equal(block.ln2.w, torch.ones_like(block.ln2.w))
        if kind == "gemma2":
            assert torch.equal(block.ln1_post.w, original.ln1_post.w)  # a write norm has no reader to fold into
    if kind == "gemma2":
        with pytest.raises(ValueError, match="center_unembed=False"):
            process_weights(model, center_writing_weights=False)
