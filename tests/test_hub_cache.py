"""Checkpoints named by Hugging Face Hub id, found in the local Hugging Face cache as
huggingface_hub lays it out (models--ORG--NAME: refs/main naming a snapshot, whose files are
links to blobs). Nothing is downloaded."""
import os
import shutil
import subprocess
import sys

import pytest

import diffuserve as ds

from chat_checkpoint import write_chat_checkpoint

REPO_ID = "example-org/tiny-diffusion"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("hub") / "m")


def fill_cache(cache, checkpoint, refs_main=True, commits=(COMMIT,)):
    """The cache huggingface_hub leaves after downloading `checkpoint` as REPO_ID."""
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    for commit in commits:
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name in os.listdir(checkpoint):
            blob = repo / "blobs" / f"{commit[:8]}-{name}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copyfile(os.path.join(checkpoint, name), blob)
            (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if refs_main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commits[-1])
    return repo / "snapshots" / commits[-1]


def test_a_hub_id_loads_the_cached_snapshot(checkpoint, tmp_path, monkeypatch):
    snapshot = fill_cache(tmp_path / "hub", checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = ds.LLM(REPO_ID)
    assert llm.model.path == str(snapshot) and llm.tokenizer is not None
    params = ds.SamplingParams(max_new_tokens=16, seed=3)
    assert llm.generate(["hello"], params)[0].token_ids == ds.LLM(checkpoint).generate(["hello"], params)[0].token_ids


def test_hf_home_and_refs_main_choose_the_snapshot(checkpoint, tmp_path, monkeypatch):
    """HF_HOME's hub folder where HF_HUB_CACHE is not set; of two snapshots, refs/main's; one
    snapshot alone where the cache keeps no refs/main."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    newest = fill_cache(tmp_path / "home" / "hub", checkpoint, commits=("a" * 40, COMMIT))
    assert ds.Model.load(REPO_ID).path == str(newest)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "other"))
    only = fill_cache(tmp_path / "other" / "hub", checkpoint, refs_main=False)
    assert ds.Model.load(REPO_ID).path == str(only)
    # huggingface_hub's older name, with a variable in it, as it expands them.
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "$DIFFUSERVE_TEST_CACHE/hub")
    monkeypatch.setenv("DIFFUSERVE_TEST_CACHE", str(tmp_path / "home"))
    assert ds.Model.load(REPO_ID).path == str(newest)


def test_an_id_not_in_the_cache_says_where_it_looked(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ds.CheckpointError, match=r"'example-org/tiny-diffusion' is not a checkpoint directory, nor "
                                                 r"a model in the Hugging Face cache \(.*empty; .*downloads nothing: "
                                                 r"fetch it first \(hf download example-org/tiny-diffusion\)"):
        ds.LLM(REPO_ID)
    empty_ref = fill_cache(tmp_path / "empty_ref", checkpoint).parent.parent / "refs" / "main"
    empty_ref.write_text("\n")  # (had named the snapshots folder itself)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_ref"))
    with pytest.raises(ds.CheckpointError, match="is not a checkpoint directory, nor a model in the Hugging Face"):
        ds.Model.load(REPO_ID)
    fill_cache(tmp_path / "two", checkpoint, refs_main=False, commits=("a" * 40, COMMIT))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "two"))
    with pytest.raises(ds.CheckpointError, match="holds 2 snapshots of it .* but no refs/main to choose one"):
        ds.Model.load(REPO_ID)


def test_a_path_that_exists_is_a_path(checkpoint, tmp_path, monkeypatch):
    """A folder named like an id, relative to the working directory, is that folder, not the cache's."""
    fill_cache(tmp_path / "hub", checkpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    shutil.copytree(checkpoint, tmp_path / "work" / REPO_ID)
    monkeypatch.chdir(tmp_path / "work")
    assert ds.Model.load(REPO_ID).path == REPO_ID


def test_the_cli_serves_names_and_quantizes_a_hub_id(checkpoint, tmp_path):
    fill_cache(tmp_path / "hub", checkpoint)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"))
    run = lambda *args: subprocess.run([sys.executable, "-m", "diffuserve", *args], env=env, capture_output=True,
                                       text=True, timeout=300)
    generated = run("generate", "-m", REPO_ID, "--max-tokens", "16", "--seed", "1", "hello")
    assert generated.returncode == 0 and generated.stdout, generated.stderr
    quantized = run("quantize", REPO_ID, str(tmp_path / "fp8"), "--scheme", "fp8-dynamic")
    assert quantized.returncode == 0, quantized.stderr
    assert ds.Model.load(tmp_path / "fp8").config["vocab_size"] == ds.Model.load(checkpoint).config["vocab_size"]
