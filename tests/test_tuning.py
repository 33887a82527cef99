"""Launch configs tuned on the GPU at hand (``hf-dilated tune``): the on-disk store, the order in which configs are
chosen (forced, tuned, built-in), and the tuner itself, run on the CPU under the Triton interpreter at a tiny size
with a stand-in timer (the real timing needs a GPU)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytest.importorskip("triton")

from hf_dilated import cli  # noqa: E402
from hf_dilated.ops.triton import configs, launch, tuned, tuning  # noqa: E402

KEY = "Test GPU|sm90|triton 0"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DILATED_CACHE", str(tmp_path))
    tuned.reload()
    yield tmp_path / tuned.FILE_NAME
    tuned.reload()


def test_store_and_lookup(cache):
    fwd = tuned.entry_key("fwd", 128, torch.bfloat16)
    assert fwd == "fwd|128|bfloat16"
    tuned.store({fwd: (64, 64, 4, 3)}, KEY)
    tuned.store({tuned.entry_key("dq", 128, torch.bfloat16): (128, 64, 8, 3)}, KEY)  # merged, not replaced
    assert tuned.lookup("fwd", 128, torch.bfloat16, key=KEY) == (64, 64, 4, 3)
    assert tuned.lookup("dq", 128, torch.bfloat16, key=KEY) == (128, 64, 8, 3)
    assert tuned.lookup("fwd", 128, torch.float16, key=KEY) is None
    assert tuned.lookup("fwd", 128, torch.bfloat16, key="Other GPU|sm80|triton 0") is None
    assert json.loads(cache.read_text())[KEY][fwd] == [64, 64, 4, 3]
    assert not list(cache.parent.glob(".triton-configs-*"))  # the temporary file was renamed into place


def test_unreadable_file_is_ignored_with_a_warning(cache):
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuned Triton configs"):
        assert tuned.lookup("fwd", 64, torch.bfloat16, key=KEY) is None
    cache.write_text(json.dumps({KEY: {"fwd|64|bfloat16": [64, "x", 4, 3]}}))
    tuned.reload()
    with pytest.warns(UserWarning, match="ignoring the tuned Triton config"):
        assert tuned.lookup("fwd", 64, torch.bfloat16, key=KEY) is None  # a malformed entry is no config


def test_unusable_tables_and_entries_are_ignored_with_a_warning(cache):
    """A device table that is not an object, or an entry that could not be launched (a 48-row block, 3 warps), is
    no config: one warning, the built-in tables apply (never an error inside a forward pass)."""
    cache.write_text(json.dumps({KEY: [1, 2], "Other|sm90|triton 0": {"fwd|64|bfloat16": [64, 64, 4, 3]}}))
    with pytest.warns(UserWarning, match="not an object"):
        assert tuned.lookup("fwd", 64, torch.bfloat16, key=KEY) is None
    assert tuned.lookup("fwd", 64, torch.bfloat16, key="Other|sm90|triton 0") == (64, 64, 4, 3)
    for bad in ([48, 64, 4, 3], [64, 64, 3, 3], [64, 512, 4, 3], [64, 64, 4, 0], [64, 64, 4, True]):
        cache.write_text(json.dumps({KEY: {"fwd|64|bfloat16": bad}}))
        tuned.reload()
        with pytest.warns(UserWarning, match=re.escape(f"ignoring the tuned Triton config fwd|64|bfloat16: {bad!r}")):
            assert tuned.lookup("fwd", 64, torch.bfloat16, key=KEY) is None
    with pytest.raises(ValueError, match="power-of-two blocks"):
        tuned.store({"fwd|64|bfloat16": (48, 64, 4, 3)}, KEY)


def test_store_keeps_what_another_process_stored_meanwhile(cache):
    """The tuner reads the file when it starts and stores minutes later: a table another process wrote in between
    survives (the store re-reads under a lock), and the file is readable by other users."""
    tuned.store({"fwd|64|bfloat16": (64, 64, 4, 3)}, KEY)
    assert tuned.lookup("fwd", 64, torch.bfloat16, key=KEY) == (64, 64, 4, 3)  # read and cached
    data = json.loads(cache.read_text())
    data["GPU B|sm80|triton 0"] = {"dq|64|bfloat16": [64, 64, 4, 2]}
    cache.write_text(json.dumps(data))  # another process, behind this one's cached read
    tuned.store({"dq|64|bfloat16": (128, 64, 8, 3)}, KEY)
    after = json.loads(cache.read_text())
    assert after["GPU B|sm80|triton 0"] == {"dq|64|bfloat16": [64, 64, 4, 2]}
    assert after[KEY] == {"fwd|64|bfloat16": [64, 64, 4, 3], "dq|64|bfloat16": [128, 64, 8, 3]}
    assert cache.stat().st_mode & 0o777 == 0o644


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be one of fwd, dkdv, dq"):
        tuned.entry_key("bwd", 64, torch.bfloat16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        with configs.forced("decode", (16, 16, 4, 1)):
            pass


def test_configs_choose_forced_then_tuned_then_table(monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_hopper", lambda: True)
    found = {("fwd", 128, torch.bfloat16): (32, 32, 4, 2)}
    monkeypatch.setattr(tuned, "lookup", lambda kernel, d, dtype: found.get((kernel, d, dtype)))
    as_tuple = lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])  # noqa: E731
    assert as_tuple(configs.fwd_config(128, torch.bfloat16)) == (32, 32, 4, 2)  # tuned
    assert as_tuple(configs.fwd_config(64, torch.bfloat16)) == configs._FWD_HOPPER[64]  # built-in
    m, n, w, s = configs._FWD_HOPPER[64]
    assert as_tuple(configs.fwd_config(64, torch.float32)) == (max(m // 2, 16), max(n // 2, 16), w, max(s - 1, 1))
    kv, q = configs.bwd_config(128, torch.bfloat16)
    assert (as_tuple(kv), as_tuple(q)) == (configs._BWD_KV_HOPPER[128], configs._BWD_Q_HOPPER[128])
    with configs.forced("fwd", (16, 32, 4, 1)), configs.forced("dq", (16, 16, 4, 1)):
        assert as_tuple(configs.fwd_config(128, torch.bfloat16)) == (16, 32, 4, 1)
        assert as_tuple(configs.bwd_config(128, torch.bfloat16)[1]) == (16, 16, 4, 1)
    assert as_tuple(configs.fwd_config(128, torch.bfloat16)) == (32, 32, 4, 2)  # the override ended with the block


def test_tune_measures_checks_and_stores(cache):
    """Every candidate runs through the real kernels (interpreter), a broken one is skipped with its error, the
    stand-in timer's fastest is stored and then chosen."""
    speed = {None: 3.0, (16, 16, 4, 1): 2.0, (32, 16, 4, 1): 1.0, (16, 32, 4, 1): 1.5}
    timed = []

    switch = {}

    def timer(fn):
        fn()
        config = next(iter(configs._FORCED.values()), None)  # the candidate being timed (None: the current config)
        timed.append(config)
        kernel = next(iter(configs._FORCED), None)
        if kernel:  # every candidate is timed on the portable kernels (the Gluon ones would ignore its config)
            switch.setdefault(kernel, set()).add(os.environ.get("HF_DILATED_GLUON"))
        return speed[config]

    def candidates_of(kernel, d):
        return [(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1), (16, 24, 4, 1)]  # 24: not a power of two

    before = dict(launch.LAUNCHES)
    trials = tuning.tune((16,), (torch.float32,), seq_len=48, heads=2, key=KEY, timer=timer,
                         candidates_of=candidates_of, progress=False)
    assert all(launch.LAUNCHES[k] > before.get(k, 0) for k in ("forward", "backward"))  # the kernels ran
    assert [(t.kernel, t.config) for t in trials] == [
        (k, c) for k in tuned.KERNELS for c in [None] + candidates_of(k, 16)]
    broken = [t for t in trials if t.config == (16, 24, 4, 1)]
    assert len(broken) == 3 and all(t.ms is None and t.error for t in broken)
    assert all(t.error is None for t in trials if t.config != (16, 24, 4, 1))
    assert (16, 24, 4, 1) not in timed  # refused before it was timed
    for kernel in tuned.KERNELS:
        assert tuned.lookup(kernel, 16, torch.float32, key=KEY) == (32, 16, 4, 1)
    assert switch == dict.fromkeys(tuned.KERNELS, {"0"})


def test_tune_refuses_bad_arguments():
    with pytest.raises(ValueError, match="head_dims must be"):
        tuning.tune((48,), key=KEY)
    with pytest.raises(ValueError, match="dtypes must be"):
        tuning.tune((64,), (torch.int8,), key=KEY)
    with pytest.raises(ValueError, match="kernels must be"):
        tuning.tune((64,), kernels=("bwd",), key=KEY)
    with pytest.raises(ValueError, match="seq_len must be"):
        tuning.tune((64,), seq_len=8, key=KEY)


def test_cli_tune_refuses_without_a_gpu_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine: no real tune here
    for argv, message in ((["tune"], "on a CUDA GPU"),
                          (["tune", "--head-dims", "512"], "--head-dims must be at most 256"),
                          (["tune", "--seq-len", "8"], "--seq-len must be at least 16")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.gpu
def test_gpu_tune_stores_for_this_device(cache):
    """On a CUDA GPU: the real timer and kernels at a small size; the winner is stored under this GPU's key and the
    kernels' config lookup finds it."""
    if not torch.cuda.is_available() or configs.interpreting():
        pytest.skip("needs a CUDA GPU")
    two = lambda kernel, d: tuning.candidates(kernel, d)[:2]  # noqa: E731
    trials = tuning.tune((64,), (torch.bfloat16,), seq_len=4096, heads=4, kernels=("fwd",), candidates_of=two,
                         progress=False)
    assert len(trials) == 3 and trials[0].config is None and trials[0].ms > 0
    best = min((t for t in trials if t.ms is not None), key=lambda t: t.ms)
    stored = tuned.lookup("fwd", 64, torch.bfloat16)
    assert stored == (best.config if best.config is not None else None)
    if stored is not None:
        c = configs.fwd_config(64, torch.bfloat16)
        assert (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) == stored
