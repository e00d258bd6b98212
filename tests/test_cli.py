"""The `probe` command: outputs written safely, errors as one line with a non-zero exit."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from probe.cli import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cache_writes_activations_that_match_the_model(tiny_dir, tiny_model, tmp_path, capsys):
    out = tmp_path / "cache"
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "To be, or not",
                           "--names", "blocks.*.hook_resid_post", "--names", "hook_embed", "--out", str(out))
    assert code == 0, err
    saved = load_file(str(out / "activations.safetensors"))
    assert set(saved) == {"blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "hook_embed", "attention_mask"}
    _, cache = tiny_model.run_with_cache("To be, or not", names=["blocks.1.hook_resid_post"])
    torch.testing.assert_close(saved["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_post"])
    index = json.loads((out / "index.json").read_text())
    assert {row["name"] for row in index} == set(saved)
    assert f"wrote {out / 'activations.safetensors'}" in err

    code, shown, _ = run_cli(capsys, "cache", "--show", str(out / "activations.safetensors"))
    assert code == 0 and "blocks.1.hook_resid_post" in shown and "4 tensors" in shown


def test_cache_refuses_a_non_empty_output_directory(tiny_dir, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "activations.safetensors").write_text("my earlier results")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(out))
    assert code == 2 and "not empty" in err and "--force" in err
    assert (out / "activations.safetensors").read_text() == "my earlier results"
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(out), "--force")
    assert code == 0, err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--names", "blocks.*.hook_resid_psot"], "matches no hook point"),
        (["--model", "/no/such/dir"], "cannot load --model"),
        (["--prompt", "word " * 100], "n_ctx=48"),
        (["--device", "cuda:7"], "--device cuda:7"),  # no CUDA here, or no 8th device on a GPU machine
    ],
)
def test_cache_errors_are_one_line(tiny_dir, tmp_path, capsys, args, message):
    base = ["cache", "--model", str(tiny_dir), "--prompt", "hello", "--out", str(tmp_path / "o")]
    code, _, err = run_cli(capsys, *base, *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o" / "activations.safetensors").exists()


def test_output_that_is_a_file_or_unwritable(tiny_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(afile))
    assert code == 2 and "is a file" in err
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(afile / "sub"))
    assert code == 2 and "cannot be written" in err  # fails for root too, unlike the permission check below
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompt", "hi", "--out", str(locked / "sub"))
        import os

        if os.geteuid() != 0:  # root writes anywhere; the check is still exercised for other users
            assert code == 2 and "cannot be written" in err
    finally:
        locked.chmod(0o700)


def test_prompts_file_errors(tiny_dir, tmp_path, capsys):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompts-file", str(binary), "--out", str(tmp_path / "o"))
    assert code == 2 and "not UTF-8" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run_cli(capsys, "cache", "--model", str(tiny_dir), "--prompts-file", str(empty), "--out", str(tmp_path / "o"))
    assert code == 2 and "no prompts" in err


def test_anatomy_ledger_matches_the_model(tiny_dir, tiny_model, tmp_path, capsys):
    import pandas as pd

    code, printed, err = run_cli(capsys, "anatomy", "--model", str(tiny_dir), "--out", str(tmp_path / "a"))
    assert code == 0, err
    ledger = pd.read_csv(tmp_path / "a" / "ledger.csv")
    assert ledger["params"].sum() == sum(p.numel() for p in tiny_model.parameters())
    assert "blocks.0.attn.hook_pattern" in printed
    assert "blocks.0.attn.hook_pattern" in (tmp_path / "a" / "anatomy.html").read_text()


def test_unknown_command_and_help(capsys):
    code, _, err = run_cli(capsys, "cahce")
    assert code == 2 and "did you mean 'cache'" in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["cache", "--help"])
    assert exit_info.value.code == 0 and "example" in capsys.readouterr().out


def test_script_runs_standalone(tiny_dir, tmp_path):
    result = subprocess.run([sys.executable, "scripts/anatomy.py", "--model", str(tiny_dir), "--out", str(tmp_path / "s"), "--quiet"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # --quiet prints only where the results went (issue 22)
    assert (tmp_path / "s" / "ledger.csv").is_file() and result.stderr == f"results in {tmp_path / 's'}\n"


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "example" in out and "--model" in out and "--out" in out


def test_report_on_a_checkpoint_writes_every_section_and_true_numbers(tiny_dir, tiny_model, tmp_path, capsys, monkeypatch):
    import pandas as pd

    heldout = tmp_path / "heldout.txt"
    heldout.write_text("To be, or not to be, that is the question. " * 40)
    monkeypatch.setattr("probe.HELDOUT_TEXT", heldout)
    monkeypatch.setattr("probe.bundled.HELDOUT_TEXT", heldout)
    from probe.analyses import pruning

    monkeypatch.setattr(pruning, "HELDOUT_TEXT", heldout, raising=False)
    prompt = "To be, or not to be <script>x</script>"
    corrupted = "To be, or not to be <script>y</script>"
    out = tmp_path / "report"
    code, _, err = run_cli(capsys, "report", "--model", str(tiny_dir), "--prompt", prompt, "--corrupted", corrupted, "--out", str(out))
    assert code == 0, err
    page = (out / "report.html").read_text()
    for anchor in ("model", "prompt", "lens", "attribution", "attention", "detectors", "ablation", "patching", "circuit",
                   "memories", "importance"):
        assert f'id="{anchor}"' in page, anchor
    from probe.analyses import circuit_graph

    assert len(pd.read_csv(out / "edges.csv")) == circuit_graph(tiny_model).n_edges
    assert "<script>x</script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    # the interactive attention view: the prompt's tokens as written, the model's own attention weights
    view = json.loads(re.search(r'<section id="attention-view">.*?class="pa-data">(.*?)</script>', page, re.S).group(1))
    assert "".join(view["tokens"][1:]) == prompt.replace(" ", "␣")
    _, cache = tiny_model.run_with_cache(prompt, names=["blocks.1.attn.hook_pattern"])
    last = cache["blocks.1.attn.hook_pattern"][0, 2, -1]
    assert view["rows"][1][2][-1] == pytest.approx(last.tolist(), abs=1e-4)
    with torch.no_grad():
        probs = tiny_model(prompt)[0, -1].softmax(-1)
    prediction = pd.read_csv(out / "prediction.csv")
    assert prediction["id"][0] == int(probs.argmax())
    assert abs(prediction["probability"][0] - float(probs.max())) < 1e-5


def test_memories_with_a_missing_corpus(tiny_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "memories", "--model", str(tiny_dir), "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "m"))
    assert code == 2 and "does not exist" in err


def test_bad_flag_is_a_usage_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lens", "--model", str(tiny_dir), "--prompt", "x", "--no-such-flag"])
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


# ---- bad flag values: one line, exit 2, and nothing written ----------------------------------------
def _binary_file(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00\x01")
    return str(path)


def _blank_file(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n  \n")
    return str(path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["contributions", "--prompt", "To be", "--position", "99"], "--position 99"),
        (["contributions", "--prompt", "To be", "--position", "-99"], "--position -99"),
        (["contributions", "--prompt", "To be", "--answer", "5", "--counterfactual", "5"], "--counterfactual"),
        (["ablate", "--prompt", "To be", "--heads", "0.1", "--top", "100000"], "--top 100000"),
        (["ablate", "--prompt", "To be", "--heads", "0.1", "--top", "0"], "--top 0"),
        (["ablate", "--prompt", "To be", "--heads", ""], "--heads"),
        (["ablate", "--prompt", "To be", "--heads", "0.1", "--method", "mean"], "--reference-file"),
        (["ablate", "--prompt", "To be", "--sweep", "--method", "resample"], "--reference-file"),
        (["ablate", "--prompt", "To be", "--heads", "0.1", "--method", "mean", "--reference-file", _binary_file], "not UTF-8"),
        (["ablate", "--prompt", "To be", "--heads", "0.1", "--method", "mean", "--reference-file", _blank_file], "holds no prompts"),
        (["attention", "--prompt", "To be", "--layer", "0", "--head", "9"], "--head 9"),
        (["attention", "--prompt", "To be", "--layer", "0", "--head", "-1"], "--head -1"),
        (["anatomy", "--n-ctx", "0"], "--n-ctx 0"),
        (["anatomy", "--n-ctx", "-5"], "--n-ctx -5"),
        (["anatomy", "--device", "foo"], "--device foo"),
        (["lens", "--prompt", "To be", "--target", "\u00b2"], "--target"),
        (["report", "--prompt", ""], "--prompt"),
        (["report", "--prompt", "To be", "--answer", "5", "--counterfactual", "5"], "--counterfactual"),
        (["report", "--prompt", "To be", "--corrupted", "To be"], "--corrupted"),
    ],
)
def test_bad_values_are_one_line_errors_and_write_nothing(tiny_dir, tmp_path, capsys, argv, message):
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, *argv, "--model", str(tiny_dir), "--out", str(out))
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_report_skip_takes_only_sections_it_can_skip(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--model", str(tiny_dir), "--skip", "lens", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_run_command_errors_are_one_line(capsys):
    """A library message spanning lines (the hub's errors do) and a CUDA out-of-memory both come out as one line."""
    import argparse

    from probe.cli.common import add_common_arguments, run_command

    parser = argparse.ArgumentParser()
    add_common_arguments(parser, output=False)

    def multi_line(args):
        raise ValueError("could not download gpt2 (Got: ConnectError\nAn error happened).\nOn a machine with network access ...")

    def out_of_memory(args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nSee documentation")

    for fn, words in ((multi_line, "could not download gpt2"), (out_of_memory, "out of memory")):
        code = run_command(fn, parser, [])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_device_that_torch_cannot_use_is_a_one_line_error(tiny_dir, tmp_path, capsys):
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    code, _, err = run_cli(capsys, "anatomy", "--model", str(tiny_dir), "--device", "mps", "--out", str(tmp_path / "o"))
    assert code == 2 and "--device mps" in err and "Traceback" not in err


# ---- answer / counterfactual -------------------------------------------------------------------------
def test_report_default_counterfactual_is_never_the_answer(tiny_dir, tiny_model, tmp_path, capsys):
    """With --answer set to the model's second choice, the contrast must be its first choice, not the answer itself."""
    import pandas as pd

    prompt = "To be, or not to be"
    with torch.no_grad():
        first, second = tiny_model(prompt)[0, -1].topk(2).indices.tolist()
    out = tmp_path / "report"
    code, _, err = run_cli(capsys, "report", "--model", str(tiny_dir), "--prompt", prompt, "--answer", str(second),
                           "--skip", "memories", "importance", "--out", str(out))
    assert code == 0, err
    frame = pd.read_csv(out / "attribution.csv", keep_default_na=False)
    strings = tiny_model.tokenizer.token_strings([first, second])
    assert set(frame["answer"]) == {strings[1]} and set(frame["counterfactual"]) == {strings[0]}
    assert frame["contribution"].abs().sum() > 0


# ---- memories --neurons ----------------------------------------------------------------------------
def test_memories_neurons_choose_the_value_tokens_reported(tiny_dir, tmp_path, capsys):
    """--neurons picks the neurons whose value tokens are written; the top token is argmax(v_i W_U) from the raw weights."""
    import pandas as pd
    from safetensors.torch import load_file

    out = tmp_path / "m"
    code, _, err = run_cli(capsys, "memories", "--model", str(tiny_dir), "--prompt", "To be, or not", "--layers", "1",
                           "--neurons", "3", "17", "--out", str(out))
    assert code == 0, err
    frame = pd.read_csv(out / "value_tokens_L1.csv", keep_default_na=False)
    assert set(frame["neuron"]) == {3, 17}
    weights = load_file(str(tiny_dir / "model.safetensors"))
    values = weights["transformer.h.1.mlp.c_proj.weight"]  # Conv1D: [d_mlp d_model], row i is v_i
    logits = values @ weights["transformer.wte.weight"].T  # tied unembedding
    for neuron in (3, 17):
        rows = frame[(frame["neuron"] == neuron) & (frame["direction"] == "promoted")].sort_values("rank")
        assert int(rows["token_id"].iloc[0]) == int(logits[neuron].argmax())


# ---- the quickstart ----------------------------------------------------------------------------------
def test_quickstart_handles_a_pruned_model(tiny_model, tmp_path, capsys):
    """Layers of a structurally pruned model have fewer heads than cfg.n_heads; the quickstart loops over each layer's own."""
    import re

    from probe.analyses import ablate_heads, prune_heads, save_pruned
    from probe.cli import quickstart

    pruned = prune_heads(tiny_model, [(0, 1), (0, 2), (1, 0)])
    save_pruned(pruned, tmp_path / "pruned")
    prompt = "To be, or not"
    assert quickstart.main(["--model", str(tmp_path / "pruned"), "--prompt", prompt]) == 0
    printed = capsys.readouterr().out
    match = re.search(r"zeroing head L(\d+)H(\d+) lowers log p\(.*\) the most: by (-?[\d.]+) nats", printed)
    assert match, printed
    tokens = pruned.to_tokens(prompt)
    with torch.no_grad():
        clean = pruned(tokens)[0, -1].log_softmax(-1)
    target = int(clean.argmax())
    drops = {(l, h): float(clean[target] - ablate_heads(pruned, tokens, [(l, h)])[0, -1].log_softmax(-1)[target])
             for l in range(pruned.cfg.n_layers) for h in range(pruned.cfg.layer_heads(l))}
    best = max(drops, key=drops.get)
    assert (int(match[1]), int(match[2])) == best
    assert abs(float(match[3]) - drops[best]) < 1e-3


def test_quickstart_runs_standalone_and_prints_true_numbers(bundled_model):
    """`python scripts/quickstart.py` from a checkout, as the README says; its numbers checked against the model.
    (Its speed is not asserted here: a shared machine's timing is noise; the timeout only catches a hang.)"""
    import os
    import re

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "scripts/quickstart.py"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    n_params = sum(p.numel() for p in bundled_model.parameters())
    assert f"{n_params:,} parameters" in printed
    prompt = "ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the"
    n_tokens = bundled_model.to_tokens(prompt).shape[1]
    assert f"({n_tokens} tokens)" in printed
    assert f"blocks.0.attn.hook_pattern (1, {bundled_model.cfg.layer_heads(0)}, {n_tokens}, {n_tokens})" in printed
    with torch.no_grad():
        top = int(bundled_model(prompt)[0, -1].argmax())
    assert re.search(r"next token: (.*?) \d", printed)[1] == repr(bundled_model.tokenizer.decode([top]))


def test_ablate_mean_matches_a_hand_written_hook(tiny_dir, tiny_model, tmp_path, capsys):
    """--method mean with --reference-file: each position's z of the head becomes the references' mean there."""
    import pandas as pd

    prompt = "To be, or not"
    references = ["The quick brown dog sleeps on and on", "When in the course of human events", "Numbers 0123456789 and more"]
    refs = tmp_path / "refs.txt"
    refs.write_text("\n".join(references) + "\n")
    out = tmp_path / "ablate"
    code, _, err = run_cli(capsys, "ablate", "--model", str(tiny_dir), "--prompt", prompt, "--heads", "1.2", "--method", "mean",
                           "--reference-file", str(refs), "--out", str(out))
    assert code == 0, err

    n = tiny_model.to_tokens(prompt).shape[1]
    with torch.no_grad():
        zs = [tiny_model.run_with_cache(r, names=["blocks.1.attn.hook_z"])[1]["blocks.1.attn.hook_z"][0, :n, 2] for r in references]
        mean = torch.stack(zs).mean(0)  # [pos d_head]; every reference is longer than the prompt

        def replace(z, hook):
            z = z.clone()
            z[0, :, 2] = mean
            return z

        clean = tiny_model(prompt)[0, -1].softmax(-1)
        ablated = tiny_model.run_with_hooks(prompt, fwd_hooks=[("blocks.1.attn.hook_z", replace)])[0, -1].softmax(-1)
    table = pd.read_csv(out / "next_token.csv", keep_default_na=False)
    ids = torch.tensor(table["token_id"].tolist())
    torch.testing.assert_close(torch.tensor(table["p_clean"].tolist()), clean[ids])
    torch.testing.assert_close(torch.tensor(table["p_ablated"].tolist()), ablated[ids])
    assert int(table["token_id"].iloc[0]) == int(clean.argmax())


def test_attention_writes_patterns_detectors_and_copying_scores(tiny_dir, tiny_model, tmp_path, capsys):
    from probe.analyses import copying_scores

    out = tmp_path / "attention"
    code = cli.main(["attention", "--model", str(tiny_dir), "--prompt", "To be, or not to be", "--detectors", "induction",
                     "--samples", "2", "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    written = pd.read_csv(out / "copying_scores.csv")
    expected = copying_scores(tiny_model).to_frame()
    assert list(written.layer) == list(expected.layer) and list(written["head"]) == list(expected["head"])
    assert written.copying_score.tolist() == pytest.approx(expected.copying_score.tolist(), abs=1e-6)
    assert {"patterns.csv", "scores_induction.csv", "copying_scores.html", "composition_k.html",
            "attention_view.html"} <= {p.name for p in out.iterdir()}
    from probe.analyses import attention_view  # the interactive view holds the prompt's own attention weights

    page = (out / "attention_view.html").read_text(encoding="utf-8")
    assert attention_view(tiny_model, "To be, or not to be").data()["rows"] == \
        json.loads(re.search(r'class="pa-data">(.*?)</script>', page, re.S).group(1))["rows"]
    from probe.analyses import composition_scores

    composition = pd.read_csv(out / "composition.csv")
    expected = composition_scores(tiny_model).to_frame()
    assert composition.k.tolist() == pytest.approx(expected.k.tolist(), abs=1e-6) and len(composition) == 16
    printed = capsys.readouterr().out
    assert "OV copying:" in printed and "K-composition:" in printed


def test_a_hub_name_offline_says_to_pass_a_directory_as_model(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    code = cli.main(["anatomy", "--model", "gpt2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "then pass that local directory as --model" in err and "from_pretrained" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_pythia_model_from_the_cache_by_revision_through_the_commands(tmp_path, capsys, monkeypatch):
    """`--model pythia-70m --revision step1000` reads that branch from the local cache; the revision is
    recorded with the activations and in the report; `--mid` is refused with the reason on parallel blocks."""
    import huggingface_hub.constants as hub
    from safetensors import safe_open

    from conftest import train_tokenizer
    from test_variants import build

    from probe import HookedDecoder

    snapshot = tmp_path / "models--EleutherAI--pythia-70m" / "snapshots" / ("7" * 40)
    (snapshot.parent.parent / "refs").mkdir(parents=True)
    (snapshot.parent.parent / "refs" / "step1000").write_text("7" * 40)
    tokenizer = train_tokenizer()
    build("neox", snapshot, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=256)
    tokenizer.save(str(snapshot / "tokenizer.json"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    model = ["--model", "pythia-70m", "--revision", "step1000"]
    code, _, err = run_cli(capsys, "cache", *model, "--prompt", "To be, or not", "--names", "blocks.1.hook_resid_post",
                           "--out", str(tmp_path / "cache"))
    assert code == 0, err
    with safe_open(str(tmp_path / "cache" / "activations.safetensors"), "pt") as f:
        assert f.metadata()["revision"] == "step1000"
        saved = f.get_tensor("blocks.1.hook_resid_post")
    _, cache = HookedDecoder.from_pretrained(snapshot).run_with_cache("To be, or not", names="blocks.1.hook_resid_post")
    torch.testing.assert_close(saved, cache["blocks.1.hook_resid_post"])
    code, _, err = run_cli(capsys, "lens", *model, "--prompt", "To be", "--mid", "--out", str(tmp_path / "lens"))
    assert code == 2 and "parallel blocks" in err and "drop --mid" in err
    code, _, err = run_cli(capsys, "report", *model, "--out", str(tmp_path / "report"), "--skip", "importance", "--quiet")
    assert code == 0, err
    assert "pythia-70m@step1000" in (tmp_path / "report" / "report.html").read_text()
    code, _, err = run_cli(capsys, "cache", *model[:2], "--revision", "step9", "--prompt", "x", "--out", str(tmp_path / "c9"))
    assert code == 2 and "--revision step9" in err


def test_report_has_a_section_per_sae_with_true_numbers(tiny_dir, tiny_model, tmp_path, capsys):
    """`probe report --sae DIR`: the section's features and loss recovered are what the analyses give."""
    from test_sae import random_sae

    from probe.analyses import sae_features, sae_loss_recovered

    sae = random_sae(hook="blocks.1.hook_resid_pre", seed=21)
    directory = sae.save_pretrained(tmp_path / "<sae>")
    prompt = "To be, or not to be, that is the question"
    code = cli.main(["report", "--model", str(tiny_dir), "--prompt", prompt, "--sae", str(directory),
                     "--skip", "memories", "importance", "--out", str(tmp_path / "report"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    page = (tmp_path / "report" / "report.html").read_text()
    tokens = tiny_model.to_tokens(prompt)
    loss = sae_loss_recovered(tiny_model, sae, tokens)
    assert "Sparse autoencoder at blocks.1.hook_resid_pre" in page and "&lt;sae&gt;" in page and "<sae>" not in page
    assert f"{float(loss.recovered[0]):.2f} of the loss recovered" in page
    written = pd.read_csv(tmp_path / "report" / "sae0_features.csv")
    expected = sae_features(tiny_model, sae, tokens, k=8).to_frame()
    assert written.feature.dropna().astype(int).tolist() == expected.feature.dropna().astype(int).tolist()
    code = cli.main(["report", "--model", str(tiny_dir), "--prompt", prompt, "--sae", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "r2")])
    assert code == 2 and "cannot load --sae" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists() or not any((tmp_path / "r2").iterdir())  # refused before any section


def test_memories_names_a_bad_corpus_before_the_lookup_writes_anything(tiny_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    out = tmp_path / "out"
    code = cli.main(["memories", "--model", str(tiny_dir), "--prompt", "To be, or not", "--corpus",
                     str(tmp_path / "empty.txt"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "is empty" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())  # the lookup's files used to be written first


def test_version_and_defaults_in_help(capsys):
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"probe {version('probe')}"
    with pytest.raises(SystemExit):
        cli.main(["lens", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: float32)" in shown and "(default: 0)" in shown and "(default: None)" not in shown


def toy_with_tokenizer(**config):
    """A random toy model built in-process (transformer-lens's config) reading the bundled model's tokenizer, so
    commands that take text run on it; `probe lens` is handed it in place of --model."""
    from probe import DEFAULT_MODEL, HookedDecoder, HookedTransformerConfig
    from probe.loading import load_tokenizer
    from toy_helpers import randomised

    cfg = HookedTransformerConfig(n_ctx=64, d_model=32, d_head=16, n_heads=2, n_layers=2, d_vocab=4096, **config)
    return randomised(HookedDecoder(cfg, tokenizer=load_tokenizer(DEFAULT_MODEL)), seed=5)


def test_lens_on_a_two_class_model_keeps_both_classes_and_refuses_a_larger_k(tmp_path, capsys, monkeypatch):
    """--k defaulted to 5, which a model with two output tokens (ARENA's bracket classifier) refused; the table now
    ranks both, the top one the model's own prediction, and an explicit --k 3 is a one-line error naming the fix."""
    import probe.cli.lens as lens_command

    model = toy_with_tokenizer(d_mlp=64, act_fn="relu", d_vocab_out=2, attention_dir="bidirectional")
    monkeypatch.setattr(lens_command, "load_model", lambda args: model)
    prompt = "To be, or not"
    code, _, err = run_cli(capsys, "lens", "--prompt", prompt, "--out", str(tmp_path / "lens"))
    assert code == 0, err
    table = pd.read_csv(tmp_path / "lens" / "logit_lens_topk.csv")
    assert sorted(table["rank"].unique().tolist()) == [1, 2]
    with torch.no_grad():
        predicted = model(model.to_tokens(prompt))[0].argmax(-1)
    final = table[(table.site == "blocks.1.hook_resid_post") & (table["rank"] == 1)].sort_values("position")
    assert final.top_token_id.tolist() == predicted.tolist()
    code, _, err = run_cli(capsys, "lens", "--prompt", prompt, "--k", "3", "--out", str(tmp_path / "k3"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--k=3 must be an integer in [1, d_vocab_out=2]: there are only 2; pass --k=2 or less, or leave --k unset" in err


def test_lens_mid_on_an_attention_only_model_names_the_missing_mlps(tmp_path, capsys, monkeypatch):
    """--mid was refused for "parallel blocks" whenever a model had no hook_resid_mid; an attention-only model has
    none because it has no MLPs."""
    import probe.cli.lens as lens_command

    model = toy_with_tokenizer(attn_only=True)
    monkeypatch.setattr(lens_command, "load_model", lambda args: model)
    code, _, err = run_cli(capsys, "lens", "--model", "attn-only", "--prompt", "To be", "--mid",
                           "--out", str(tmp_path / "lens"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--mid with --model attn-only: this attention-only model has no MLPs" in err and "drop --mid" in err
    assert "parallel" not in err


def _finished(err: str, desc: str) -> bool:
    """A tqdm bar named `desc` reached its total (its last refresh reads 100%)."""
    return any(part.startswith(desc) and "100%" in part for part in err.replace("\r", "\n").splitlines())


def test_long_steps_show_progress_with_totals_and_quiet_silences_them(tiny_dir, tiny_model, tmp_path, capsys):
    lens = ["lens", "--model", str(tiny_dir), "--prompt", "To be, or not", "--tuned", "--tuned-steps", "3",
            "--tuned-tokens", "300"]
    code, _, err = run_cli(capsys, *lens, "--out", str(tmp_path / "lens"))
    assert code == 0, err
    for desc in ("tuned lens: residuals", "tuned lens: training", "lens comparison: residuals",
                 "lens comparison: logit lens KL", "lens comparison: tuned lens KL"):
        assert _finished(err, desc), (desc, err)
    assert "3/3" in err  # the training bar counts the steps asked for

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. Whether 'tis nobler in the mind to suffer\n" * 6)
    code, _, err = run_cli(capsys, "prune", "--model", str(tiny_dir), "--text-file", str(text), "--max-windows", "2",
                           "--step", "0.5", "--out", str(tmp_path / "prune"))
    assert code == 0, err
    for desc in ("pruning", "baseline: single-head ablations", "baselines: their pruning curves"):
        assert _finished(err, desc), (desc, err)

    # the trigger scan's bar has a total: every token of the corpus, counted by the tokenizer itself
    n = len(tiny_model.tokenizer.encode(text.read_text(), add_special_tokens=False))
    code, _, err = run_cli(capsys, "memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(text),
                           "--layers", "0", "--neurons", "1", "2", "--k", "3", "--out", str(tmp_path / "memories"))
    assert code == 0, err
    assert _finished(err, "top_triggers") and f"{n}/{n}" in err, err
    code, _, err = run_cli(capsys, "memories", "--model", str(tiny_dir), "--triggers", "--corpus", str(text),
                           "--layers", "0", "--neurons", "1", "--k", "3", "--out", str(tmp_path / "memories-q"), "--quiet")
    assert code == 0 and "top_triggers" not in err and "%|" not in err, err  # --quiet: no bars


def _bytes_of_shown(shown: list[str]) -> bytes:
    """The text a row of `probe tokens` stands for, read back: ␣ and ⏎ as themselves, <0xE2> as its byte."""
    out = b""
    for token in shown:
        for piece in re.split(r"(<0x[0-9A-F]{2}>)", token):
            out += bytes([int(piece[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", piece) else \
                piece.replace("␣", " ").replace("⏎", "\n").encode("utf-8")
    return out


def test_tokens_shows_each_positions_id_and_string_with_whitespace_and_bytes_visible(tiny_dir, tmp_path, capsys):
    from tokenizers import Tokenizer

    prompt = "To be, or not\nto  be é"  # a newline, a double space, and é (two bytes the tiny vocabulary splits)
    code, printed, err = run_cli(capsys, "tokens", "--model", str(tiny_dir), "--prompt", prompt, "--prompt", "To be",
                                 "--out", str(tmp_path / "tokens"))
    assert code == 0, err
    frame = pd.read_csv(tmp_path / "tokens" / "tokens.csv", keep_default_na=False)
    first = frame[frame.prompt == 0]
    reference = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))  # the tokenizers library itself
    bos = reference.token_to_id("<|endoftext|>")
    assert first.id.tolist() == [bos] + reference.encode(prompt).ids
    assert first.position.tolist() == list(range(len(first)))
    assert first.shown.iloc[0] == "<|endoftext|>" and _bytes_of_shown(first.shown.iloc[1:]) == prompt.encode("utf-8")
    assert any(re.fullmatch(r"<0x[0-9A-F]{2}>", s) for s in first.shown)  # é's bytes show as bytes, not U+FFFD
    assert "⏎" in "".join(first.shown) and "\ufffd" not in printed
    for row in first.itertuples():  # the terminal table: position, id, string
        assert re.search(rf"^\s*{row.position}\s+{row.id}\s+{re.escape(row.shown)}$", printed, re.M), row
    assert "different lengths" in printed


def test_patch_says_how_each_prompt_and_answer_tokenises(tiny_dir, tiny_model, tmp_path, capsys):
    from probe.analyses.labels import shown_token

    clean, corrupted = "To be, or not to be", "To be"
    code, _, err = run_cli(capsys, "patch", "--model", str(tiny_dir), "--clean", clean, "--corrupted", corrupted,
                           "--answer", " be", "--counterfactual", " not", "--out", str(tmp_path / "patch"))
    assert code == 2 and err.count("\n") == 1, err
    for flag, prompt in (("--clean", clean), ("--corrupted", corrupted)):
        ids = tiny_model.to_tokens(prompt)[0].tolist()
        shown = " | ".join(shown_token(s) for s in tiny_model.tokenizer.token_strings(ids))
        assert f"{flag} is {len(ids)} tokens: {shown}" in err, err
    assert "probe tokens --prompt" in err and not any((tmp_path / "patch").glob("*"))

    answer = " question"
    pieces = tiny_model.tokenizer.encode(answer, add_special_tokens=False)
    assert len(pieces) > 1  # the tiny vocabulary splits it
    code, _, err = run_cli(capsys, "patch", "--model", str(tiny_dir), "--clean", "To be, or not", "--corrupted",
                           "To be, or not", "--answer", answer, "--counterfactual", " not", "--out", str(tmp_path / "patch"),
                           "--force")
    shown = " | ".join(shown_token(s) for s in tiny_model.tokenizer.token_strings(pieces))
    assert code == 2 and f"--answer ' question' is {len(pieces)} tokens: {shown}" in err, err


RUNTIME_CHECK = r"""
import importlib.abc, json, os, sys

blocked = set(json.loads(os.environ["PROBE_BLOCKED_MODULES"]))


class Hidden(importlib.abc.MetaPathFinder):  # as if the test extras had never been installed: not found at all
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]
from probe.cli import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _closure(names) -> set[str]:
    """These distributions and every distribution their runtime requirements pull in (extras left out), normalised."""
    from importlib.metadata import PackageNotFoundError, requires

    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    seen, todo = set(), list(names)
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in reqs if "extra ==" not in r]
    return seen


def test_probe_report_runs_with_only_the_runtime_dependencies(tiny_dir, tmp_path):
    """`pip install -e . && probe report` (the README's first line) needs nothing from the test extras: the report
    runs with every module that only they bring in (transformers, transformer-lens and theirs) made unimportable."""
    import os
    from importlib.metadata import packages_distributions, requires

    extras = [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires("probe") if 'extra == "test"' in r]
    test_only = _closure(extras) - _closure(["probe"])
    assert {"transformers", "transformer-lens", "pytest"} <= test_only
    blocked = sorted(module for module, dists in packages_distributions().items()
                     if {re.sub(r"[-_.]+", "-", d).lower() for d in dists} <= test_only and not module.startswith("_"))
    result = subprocess.run([sys.executable, "-c", RUNTIME_CHECK, "report", "--model", str(tiny_dir), "--skip",
                             "memories", "importance", "--out", str(tmp_path / "r"), "--quiet"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PROBE_BLOCKED_MODULES": json.dumps(blocked)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "r" / "report.html").is_file()


@pytest.mark.parametrize("argv, flag", [
    (["tokens", "--prompt", "ROMEO \udcff"], "--prompt"),  # how Python hands over a command line's byte 0xFF
    (["lens", "--prompt", "ROMEO", "--target", "\udcff"], "--target"),
    (["cache", "--prompt", "ROMEO", "--names", "blocks.\udce9"], "--names"),
])
def test_a_text_argument_that_is_not_utf8_is_named_with_its_byte(argv, flag, tmp_path, capsys):
    """Before any model loads or any directory is made, for every command (scripts/common.run_command); the
    tokenizer's own error named neither the flag nor the byte."""
    from probe.cli import cli

    out = tmp_path / "out"
    assert cli.main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} is not UTF-8 text" in err and "byte 0x" in err and "Traceback" not in err and not out.exists()


def test_a_token_named_on_the_command_line_must_be_one_the_model_predicts():
    # answers, targets and logits name logit columns: a classifier's 2 outputs, not its 11 input tokens
    from probe import HookedDecoder, HookedTransformerConfig
    from scripts.common import CommandError, token_id

    model = HookedDecoder(HookedTransformerConfig(n_layers=1, d_model=8, d_head=4, n_ctx=4, d_vocab=11, d_vocab_out=2,
                                                  act_fn="relu"))
    assert token_id(model, "1", "--answer") == 1
    with pytest.raises(CommandError, match=r"--answer 7 is not an output token id in \[0, 2\)"):
        token_id(model, "7", "--answer")
