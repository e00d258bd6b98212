"""transformer-lens's loading line, run unchanged: `from_pretrained(name, fold_ln=..., center_writing_weights=...,
refactor_factored_attn_matrices=..., default_prepend_bos=..., dtype="bf16")`, `from_pretrained_no_processing`, the
config's TL names, and `model.pos_embed(tokens)`. The oracles: transformer-lens's bridge over the same directory with
the same processing (its weights and activations), transformers' config and log-probabilities, and the weights."""
from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

import probe
from probe import DEFAULT_MODEL, HookedDecoder
from probe.checkpoints import CheckpointError
from probe.loading import SHORT_NAMES
from test_tl_compat import CASES, PROMPT, PROMPTS, classic
from tl_oracle import assert_same, booted, bridge

TL_DEFAULTS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True,
                   refactor_factored_attn_matrices=False)
WEIGHTS = ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_out", "b_out",
           "W_U", "b_U")
REFACTORED = ("hook_q", "hook_k", "hook_v", "hook_z")  # coordinates along singular directions: signs are the SVD's


@functools.lru_cache(maxsize=4)
def processed_bridge(steps: tuple):
    return booted(DEFAULT_MODEL, **dict(steps))


def sign_aligned(ours, theirs):
    """Activations [batch pos head d_head] with each head's directions' signs flipped to agree with `theirs`."""
    return ours * torch.sign((ours * theirs).sum(dim=(0, 1)))


def refactored_weights_aligned(ours, theirs):
    """Our refactored weights with each head's directions' signs flipped to agree with the bridge's: W_Q's decide
    W_Q's and b_Q's, W_K's W_K's and b_K's, W_V's W_V's and W_O's (a singular pair flips together)."""
    def signs(name):  # [layer head d_head]
        return torch.sign((getattr(ours, name) * getattr(theirs, name)).detach().sum(dim=-2))

    q, k, v = signs("W_Q"), signs("W_K"), signs("W_V")
    return {"W_Q": ours.W_Q * q[..., None, :], "b_Q": ours.b_Q * q, "W_K": ours.W_K * k[..., None, :], "b_K": ours.b_K * k,
            "W_V": ours.W_V * v[..., None, :], "W_O": ours.W_O * v[..., :, None]}


LOADING_LINES = {  # as TL code writes them
    "arena-no-processing": dict(fold_ln=False, center_unembed=False, center_writing_weights=False),
    "ioi-notebook": dict(center_unembed=True, center_writing_weights=True, fold_ln=True,
                         refactor_factored_attn_matrices=True),
    "one-keyword": dict(center_unembed=False),  # the rest take TL's defaults (True)
    "fold-only": dict(fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=False),
}


@pytest.mark.parametrize("line", LOADING_LINES)
def test_the_loading_keywords_process_as_transformer_lens_does(line):
    given = LOADING_LINES[line]
    ours = HookedDecoder.from_pretrained(DEFAULT_MODEL, **given).eval()
    theirs = processed_bridge(tuple({**TL_DEFAULTS, **given}.items()))
    refactored = given.get("refactor_factored_attn_matrices", False)
    aligned = refactored_weights_aligned(ours, theirs) if refactored else {}
    for name in WEIGHTS:
        assert_same(aligned.get(name, getattr(ours, name)), getattr(theirs, name), atol=1e-5 if name not in aligned
                    else 1e-3, what=f"{line}: {name}")
    tokens = ours.to_tokens(PROMPT)
    with torch.no_grad():
        logits, cache = ours.run_with_cache(tokens)
        their_logits, their_cache = theirs.run_with_cache(tokens)
    assert_same(logits, their_logits, what=f"{line}: logits")
    theirs_by_name = classic(dict(their_cache.items()))
    for name in cache.keys():
        mine, tl = cache[name], theirs_by_name[name]
        if refactored and name.endswith(REFACTORED):
            mine = sign_aligned(mine, tl)
        scale = tl.abs().max().clamp(min=1.0).item()  # refactored q and k reach ~10: compare relative to size
        assert_same(mine.masked_fill(mine.isinf(), 0), tl.masked_fill(tl.isinf(), 0), atol=1e-4 * scale,
                    what=f"{line}: {name}")


@pytest.mark.parametrize("family", ["neox", "qwen3", "gemma2"])
def test_other_families_process_as_the_bridge_does(family, tmp_path):
    # parallel blocks with LayerNorm (centred), RMSNorm with grouped-query heads (folded only), Gemma 2's sandwich
    # norms and capped logits (folded, no centring of the writers or of the capped unembedding, as TL skips them)
    from test_variants import build

    build(family, tmp_path)
    theirs = booted(tmp_path)  # TL's defaults
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = HookedDecoder.from_pretrained(tmp_path, fold_ln=True).eval()
    for name in WEIGHTS:
        if name == "W_pos" or (ours.blocks[0].attn.qkv.bias is None and name.startswith("b_") and name != "b_U"):
            continue  # rotary positions; the bridge refuses the biases these checkpoints lack (probe: TL 3's zeros)
        assert_same(getattr(ours, name), getattr(theirs, name), atol=1e-6, what=f"{family}: {name}")
    tokens = torch.tensor([[1, 5, 9, 22, 7, 60, 3]])
    with torch.no_grad():
        assert_same(ours(tokens), theirs(tokens), what=f"{family}: logits")


@pytest.fixture(scope="module")
def processed_models():
    steps = dict(fold_ln=True, center_writing_weights=True, center_unembed=True)  # Exploratory_Analysis_Demo's line
    return (HookedDecoder.from_pretrained(DEFAULT_MODEL, **steps).eval(),
            processed_bridge(tuple({**TL_DEFAULTS, **steps}.items())))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_tutorial_idioms_agree_on_processed_weights_too(processed_models, name):
    # test_tl_compat's cases, run on the model as the tutorials load it (processed), against the bridge processed so
    ours, theirs = processed_models
    expected = classic(CASES[name](theirs))
    if name == "cfg_fields":  # TL 4's bridge keeps "LN" after folding; HookedTransformer (TL 3) says "LNPre", as
        # probe does (tests/test_tl_state_dict.py checks that against HookedTransformer itself)
        assert expected["normalization_type"] == "LN"
        expected["normalization_type"] = "LNPre"
    assert_same(CASES[name](ours), expected, what=name)


@pytest.mark.parametrize("unit", ["component", "head", "layer"])
def test_transformer_lens_4_direct_logit_attribution_on_processed_weights(processed_models, unit):
    # TL 4's tool (tools.analysis) needs the final norm folded, as the tutorials load the model
    from transformer_lens.tools.analysis.direct_logit_attribution import direct_logit_attribution

    ours, theirs = processed_models
    mine, tl = (direct_logit_attribution(model, PROMPT, " the", " and", unit=unit) for model in (ours, theirs))
    assert_same(mine.attribution, tl.attribution, what=unit)
    assert list(mine.labels) == list(tl.labels)


def test_without_processing_keywords_the_weights_are_the_checkpoints_own(bundled_model):
    plain = {name: getattr(bundled_model, name) for name in WEIGHTS}
    no_processing = HookedDecoder.from_pretrained_no_processing(DEFAULT_MODEL)
    theirs = bridge(DEFAULT_MODEL)  # no_processing=True
    for name in WEIGHTS:
        assert_same(getattr(no_processing, name), getattr(theirs, name), atol=0, what=name)
        assert torch.equal(getattr(no_processing, name), plain[name]), name
    # from_pretrained_no_processing passes its other keywords on, as TL's does
    assert HookedDecoder.from_pretrained_no_processing(DEFAULT_MODEL, fold_ln=True).ln_final.w.eq(1).all()


def test_steps_that_do_not_apply_are_skipped_as_in_transformer_lens_and_refused_by_process_weights(tmp_path):
    import transformers

    from test_variants import build

    hf = build("llama", tmp_path)  # RMSNorm and rotary: no centring of the writers, no refactoring
    tokens = torch.tensor([[1, 5, 9, 22, 7, 60, 3]])
    with pytest.warns(UserWarning, match="skipping center_writing_weights"):
        model = HookedDecoder.from_pretrained(tmp_path, fold_ln=True).eval()
    assert all(block.ln1.w.eq(1).all() for block in model.blocks)  # folded
    with torch.no_grad():
        assert_same(model(tokens).log_softmax(-1), hf(tokens).logits.log_softmax(-1), what="llama, processed")
    # TL's loading line spelled out, as tutorials write it for any model: the centring TL skips is skipped here too
    with pytest.warns(UserWarning, match=r"skipping center_writing_weights=True \(given\)"):
        spelled = HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=True, center_unembed=True)
    for name in ("W_in", "W_Q", "W_U"):  # the model TL's defaults give
        assert_same(getattr(spelled, name), getattr(model, name), what=f"spelled out: {name}")
    with pytest.raises(ValueError, match="center_writing_weights needs every reader .* LayerNorm"):
        probe.process_weights(HookedDecoder.from_pretrained(tmp_path), center_writing_weights=True)
    with pytest.raises(ValueError, match="refactor_factored_attn_matrices needs positions that do not rotate"):
        HookedDecoder.from_pretrained(tmp_path, fold_ln=True, center_writing_weights=False,
                                      refactor_factored_attn_matrices=True)
    assert isinstance(hf, transformers.LlamaForCausalLM)


def test_dtype_names_and_half_precision_processing():
    theirs = processed_bridge(tuple(TL_DEFAULTS.items()))
    half = HookedDecoder.from_pretrained(DEFAULT_MODEL, fold_ln=True, dtype="float16")
    for name in ("W_Q", "b_Q", "W_in", "W_U", "b_U"):  # processed in float32, rounded once
        assert getattr(half, name).dtype == torch.float16
        torch.testing.assert_close(getattr(half, name), getattr(theirs, name).detach().half(), atol=1e-6, rtol=1e-3)
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL, dtype="bf16").W_E.dtype == torch.bfloat16
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float64).W_E.dtype == torch.float64
    with pytest.raises(ValueError, match="dtype='half32' is not a dtype name; use one of float32, fp32"):
        HookedDecoder.from_pretrained(DEFAULT_MODEL, dtype="half32")


def test_prepend_bos_and_padding_side_defaults_as_transformer_lens_sets_them():
    theirs = bridge(DEFAULT_MODEL)
    no_bos = HookedDecoder.from_pretrained(DEFAULT_MODEL, default_prepend_bos=False).eval()
    assert not no_bos.cfg.default_prepend_bos
    assert_same(no_bos.to_tokens(PROMPT), theirs.to_tokens(PROMPT, prepend_bos=False))
    with torch.no_grad():
        assert_same(no_bos(PROMPT), theirs(PROMPT, prepend_bos=False))
    left = HookedDecoder.from_pretrained(DEFAULT_MODEL, default_padding_side="left")
    assert_same(left.to_tokens(PROMPTS), theirs.to_tokens(PROMPTS, padding_side="left"))
    assert not torch.equal(left.to_tokens(PROMPTS), theirs.to_tokens(PROMPTS, padding_side="right"))


def test_placement_keywords_and_refusals_name_the_fix():
    # the weights stay on the CPU whatever device= says, as TL's move_to_device=False leaves them
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL, device="cuda", move_to_device=False).W_E.device.type == "cpu"
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL, n_devices=1).W_E.device.type == "cpu"
    for keywords, fix in [(dict(checkpoint_index=3), "checkpoint_value=<step>"), (dict(n_devices=2), "device_map='auto'"),
                          (dict(checkpoint_value=3000), "Pythia or Stanford CRFM's GPT-2 runs"),
                          (dict(hf_model=object()), "hf_model must be a transformers model"),
                          (dict(tokenizer=object()), "a fast transformers tokenizer"),
                          (dict(fold_layernorm=True), "'fold_layernorm'"),
                          (dict(default_prepend_bos="no"), "default_prepend_bos must be True or False, got 'no'"),
                          (dict(fold_ln=1), "fold_ln must be True or False"),
                          (dict(move_to_device="cpu"), "move_to_device must be True or False")]:
        with pytest.raises(TypeError, match=fix.replace("(", r"\(").replace("'", ".")):
            HookedDecoder.from_pretrained(DEFAULT_MODEL, **keywords)


def test_a_transformers_model_in_memory_loads_as_transformer_lens_loads_it(monkeypatch, tmp_path):
    # HookedTransformer.from_pretrained("gpt2", hf_model=fine_tuned, tokenizer=its_tokenizer): the name reads
    # nothing (the hub is never asked), the weights are the model's own, copied
    import huggingface_hub
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked for a model given in memory")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    hf = GPT2LMHeadModel.from_pretrained(str(DEFAULT_MODEL)).eval()
    with torch.no_grad():
        for param in hf.parameters():  # not the bundled model's weights any more: "fine-tuned"
            param.add_(0.01 * torch.randn_like(param))
    before = {name: p.detach().clone() for name, p in hf.named_parameters()}
    special = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{DEFAULT_MODEL}/tokenizer.json", bos_token=special,
                                        eos_token=special, pad_token=special, padding_side="left")
    tokenizer.backend_tokenizer.enable_padding(length=40)  # the caller's settings stay out of probe's copy
    model = HookedDecoder.from_pretrained("gpt2", hf_model=hf, tokenizer=tokenizer, fold_ln=True).eval()
    tokens = model.to_tokens(PROMPT)
    assert tokens[0].tolist() == [tokenizer.bos_token_id] + tokenizer.encode(PROMPT)
    with torch.no_grad():
        assert_same(model(tokens).log_softmax(-1), hf(tokens).logits.log_softmax(-1), what="processed, in memory")
    assert all(torch.equal(p, before[name]) for name, p in hf.named_parameters())  # processing touched a copy
    assert model.cfg.model_name == "gpt2" and model.cfg.original_architecture == "GPT2LMHeadModel"
    # without tokenizer=, the name's tokenizer: here a local directory's
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((Path(DEFAULT_MODEL) / "tokenizer.json").read_bytes())
    from_dir = HookedDecoder.from_pretrained(tmp_path, hf_model=hf)
    assert from_dir.to_tokens(PROMPT).tolist() == tokens.tolist()


def test_checkpoint_value_asks_the_hub_for_that_training_step(monkeypatch):
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, revision=None, **_):
        asked.append((repo_id, revision))
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for name, step, revision in [("pythia-70m", 3000, "step3000"), ("EleutherAI/pythia-160m-deduped", 0, "step0"),
                                 ("stanford-gpt2-small-a", 400000, "checkpoint-400000")]:
        asked.clear()
        with pytest.raises(CheckpointError):
            HookedDecoder.from_pretrained(name, checkpoint_value=step)
        assert asked and all(seen == (SHORT_NAMES.get(name, name), revision) for seen in asked), asked


def test_transformer_lens_short_names_name_the_same_checkpoints():
    import transformer_lens

    path = Path(transformer_lens.__file__).parent / "tools" / "model_registry" / "data" / "model_aliases.json"
    table = json.loads(path.read_text())["aliases"]  # TL's own: {official name: [its short names]}
    theirs = {alias: official for official, aliases in table.items() for alias in aliases}
    moved = {"gpt2": "openai-community/gpt2", "distilgpt2": "distilbert/distilgpt2"}  # TL's names from before the move
    shared = [name for name in SHORT_NAMES if name in theirs]
    assert len(shared) > 100
    for name in shared:
        assert SHORT_NAMES[name] == moved.get(theirs[name], theirs[name]), name
    for name in ("gpt2-small", "pythia-19m", "pythia-125m-deduped", "stanford-gpt2-small-a", "Llama-2-7b", "mistral-7b",
                 "qwen2.5-0.5b", "qwen3-4b", "distil-gpt2", "gpt-neo-125M", "neo-small", "tiny-stories-1M",
                 "tiny-stories-instruct-1L-21M", "tiny-stories-2L-33M", "opt-125m", "opt", "opt-xl", "phi-1_5", "phi-2",
                 "phi-3", "phi-4", "gemma-3-270m", "gemma-3-1b-it", "gemma-3-4b-pt",
                 "gemma-3-27b-it", "olmo-1b", "gpt-j-6B", "gptj", "olmo-2-1b", "stablelm-base-alpha-3b",
                 "gpt-neox-20b", "EleutherAI/pythia-1.3b", "Yi-6B", "medgemma-4b-it", "gpt2-mistral-small-a",
                 "attn-only-2l-c4-code", "gelu-1l-new", "attn-only-demo", "olmo-3-7b-think", "bloom-560m", "bloom-7b1", "mixtral",
                 "mixtral-8x7b-instruct", "olmoe", "gpt-oss", "apertus", "apertus-8b-instruct"):
        assert name in shared, name


# ---- the config's transformer-lens names ------------------------------------------------------------------
def test_config_names_agree_with_the_bridge_on_gpt2():
    ours, theirs = HookedDecoder.from_pretrained(DEFAULT_MODEL).cfg, bridge(DEFAULT_MODEL).cfg
    for name in ("final_rms", "attention_dir", "use_local_attn", "window_size", "output_logits_soft_cap",
                 "attn_scores_soft_cap", "use_normalization_before_and_after", "rotary_adjacent_pairs", "use_attn_scale",
                 "use_qk_norm", "initializer_range", "post_embedding_ln", "scale_attn_by_inverse_layer_idx", "seed",
                 "num_experts", "model_name", "attn_types"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.attn_scale == math.sqrt(ours.d_head)  # TL's divisor (the bridge leaves it unset: -1)
    assert ours.original_architecture == json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["architectures"][0]


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "neox"])
def test_config_names_say_what_the_checkpoint_config_says(family, tmp_path):
    from test_variants import build

    build(family, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg = HookedDecoder.from_pretrained(tmp_path).cfg
    assert cfg.original_architecture == hf["architectures"][0]
    assert cfg.final_rms == (family != "neox")
    assert cfg.output_logits_soft_cap == (hf.get("final_logit_softcapping") or -1.0)
    assert cfg.attn_scores_soft_cap == (hf.get("attn_logit_softcapping") or -1.0)
    assert cfg.use_local_attn == (hf.get("sliding_window") is not None and hf.get("use_sliding_window", True))
    assert cfg.use_normalization_before_and_after == (family == "gemma2")
    assert cfg.use_qk_norm == (family == "qwen3")
    assert cfg.attn_scale == pytest.approx(math.sqrt(hf.get("query_pre_attn_scalar") or cfg.d_head))
    if family == "gemma2":
        assert cfg.window_size == hf["sliding_window"]
        assert cfg.attn_types == ["local" if kind == "sliding_attention" else "global" for kind in hf["layer_types"]]


def test_tokenizer_vocab_is_the_hugging_face_mapping():
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL).tokenizer.vocab == bridge(DEFAULT_MODEL).tokenizer.vocab


# ---- model.pos_embed(tokens), as TL's PosEmbed takes it ---------------------------------------------------
def test_pos_embed_of_tokens_as_transformer_lens_computes_it(bundled_model):
    model = bundled_model
    tokens = model.to_tokens(PROMPTS, padding_side="left")
    W_pos = model.W_pos.detach()
    n = tokens.shape[1]
    assert_same(model.pos_embed(tokens), W_pos[:n].expand(len(PROMPTS), n, -1), atol=0)
    assert_same(model.pos_embed(tokens[:, :4], past_kv_pos_offset=3), W_pos[3:7].expand(len(PROMPTS), 4, -1), atol=0)
    mask = (tokens != model.tokenizer.pad_token_id).long()
    mask[:, 0] = 1  # the BOS, which is also the pad token
    mask[2, 0] = 0
    got = model.pos_embed(tokens, attention_mask=mask)
    for row in range(len(PROMPTS)):
        real = mask[row].nonzero()[:, 0]
        assert_same(got[row, real], W_pos[:len(real)], atol=0)  # counted along the real tokens
        assert not got[row][mask[row] == 0].any()  # padding: zeros


def test_a_forward_written_by_hand_gives_transformer_lens_logits(bundled_model):
    def by_hand(model, tokens):  # as TL code writes its own forward
        resid = model.hook_embed(model.embed(tokens)) + model.hook_pos_embed(model.pos_embed(tokens))
        for block in model.blocks:
            resid = block(resid)
        return model.unembed(model.ln_final(resid))

    tokens = bundled_model.to_tokens(PROMPT)
    with torch.no_grad():
        assert_same(by_hand(bundled_model, tokens), bridge(DEFAULT_MODEL)(tokens))
