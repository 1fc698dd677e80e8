"""services.common.cli: a reader that closes the pipe early is not an error."""
from __future__ import annotations

import subprocess
import sys


def test_output_piped_into_a_reader_that_stops_early_exits_quietly():
    program = (
        "from services.common import cli\n"
        "def main():\n"
        "    for i in range(200000):\n"
        "        print('line', i)\n"
        "    return 0\n"
        "cli.run(main)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert writer.stdout is not None
    writer.stdout.readline()
    writer.stdout.close()  # what `| head -1` does
    _, err = writer.communicate(timeout=30)
    assert writer.returncode == 0, err.decode()
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err.decode()
