"""``import hf_dilated`` is light, and the attention functions are registered as soon as Transformers loads models."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_loads_neither_torch_nor_transformers():
    out = _run("import sys, hf_dilated; print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    assert out == "[]"


def test_cli_help_and_version_load_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from hf_dilated.cli import main\n"
        "for argv in (['--help'], ['--version'], ['patch', '--help'], ['eval', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as stop:\n"
        "            assert stop.code in (0, None), (argv, stop.code)\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run(code) == "False"


@pytest.mark.parametrize("trigger", [
    "from transformers import AutoModelForCausalLM",
    "from transformers import AttentionInterface",
])
def test_registered_once_transformers_loads_models(trigger):
    code = (
        "import hf_dilated\n"
        f"{trigger}\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "names = ('dilated', 'dilated_ring', 'block_sparse')\n"
        "print(all(n in AttentionInterface._global_mapping for n in names),"
        " all(n in AttentionMaskInterface._global_mapping for n in names))\n"
    )
    assert _run(code) == "True True"


def test_registered_when_transformers_was_loaded_first():
    code = (
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "import hf_dilated\n"
        "print('dilated' in ALL_ATTENTION_FUNCTIONS._global_mapping)\n"
    )
    assert _run(code) == "True"


def test_public_names_resolve_lazily():
    import hf_dilated

    for name in hf_dilated.__all__:
        assert getattr(hf_dilated, name) is not None, name
    assert hf_dilated.ops.dilated_attention is hf_dilated.dilated_attention
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        hf_dilated.no_such_name
