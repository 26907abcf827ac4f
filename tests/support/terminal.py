"""Run a command with its standard error on a pseudo-terminal (progress lines and bars draw
only on a terminal)."""

import os
import subprocess
import threading
from pathlib import Path


def on_a_terminal(command: list, env: dict, cwd: Path, columns: int | None = 120) -> tuple[int, str, str]:
    """Run command with its standard error on a pseudo-terminal of `columns` columns (tqdm draws
    nothing on one of 0 columns; None leaves the size unset): (status, stdout, screen)."""
    import fcntl
    import pty
    import struct
    import termios

    controller, terminal = pty.openpty()
    if columns:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    chunks = []

    def drain():
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the terminal's last writer has gone
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    process = subprocess.run(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=300
    )
    os.close(terminal)
    reader.join(timeout=30)
    os.close(controller)
    return process.returncode, process.stdout, b"".join(chunks).decode(errors="replace")
