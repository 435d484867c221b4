"""decode.py --constraints as a command: a phrase it refuses is one error line, no traceback."""

import os
import subprocess
import sys

from conftest import ROOT

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def test_cli_refuses_a_phrase_the_vocabulary_cannot_spell_in_one_line(trained_tiny, tmp_path):
    terms = tmp_path / "terms.txt"
    terms.write_text("forty\n\nQ€ terms\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "decode.py", "--workdir", trained_tiny, "--constraints", str(terms)],
        cwd=ROOT,
        env=ENV,
        input=b"en 47\nde 12\nen 5\n",
        capture_output=True,
        timeout=300,
    )
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2 and result.stdout == b""
    assert err == [
        "error: constraints line 3: the target vocabulary cannot spell 'Q€ terms' (it has no "
        "piece for some of its characters); respell or drop the phrase"
    ]
