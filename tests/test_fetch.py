"""pycalm.fetch's command line: known models resolve to their cached files, unknown ones fail
with one error line (no network: the cache is filled by hand here)."""

from pycalm.fetch import KNOWN_MODELS, main


def test_fetch_prints_cached_paths(tmp_path, capsys):
    for model in KNOWN_MODELS.values():
        (tmp_path / model.name).write_bytes(b"GGUF")
    assert main(["smollm2", "qwen2.5-coder-0.5b", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(tmp_path / KNOWN_MODELS[k].name) for k in ("smollm2", "qwen2.5-coder-0.5b")]


def test_fetch_unknown_model(tmp_path, capsys):
    assert main(["nope", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'") and "smollm2" in err
