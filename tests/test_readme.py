"""The README's Python quickstarts run as written."""

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
BLOCKS = re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    if "integrations import apply_dlm_kernels_to_diffusion_gemma" in BLOCKS[index]:
        pytest.importorskip("transformers.models.diffusion_gemma")
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})


def test_readme_has_blocks_and_ci_uses_its_test_command():
    assert len(BLOCKS) >= 2
    text = open(README).read()
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run")).read()
    commands = re.findall(r"```bash\n(.*?)\n\s*```", text, flags=re.S)
    test_cmd = [c.strip() for c in commands if "pytest" in c]
    assert test_cmd and test_cmd[0] in ci
