"""`import protocols` must stay light: peers that only speak the protocol need no ML stack."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "hivemind", "llama_cpp", "peft")


def test_import_protocols_loads_no_heavy_module():
    code = (
        "import sys, protocols, protocols.messages, protocols.signing, protocols.delta, protocols.sync\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_check_itself_sees_heavy_modules():
    # Guards the test above against passing vacuously (e.g. a wrong module name).
    code = "import sys, torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
