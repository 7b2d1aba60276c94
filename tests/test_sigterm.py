"""Every ray.init in treeflow gives SIGTERM back to the command (Ray's handler aborts, rc -6)."""

import signal

from treeflow.sigterm import keep_sigterm


def test_keep_sigterm_restores_the_handler_a_library_replaced():
    def ours(signum, frame):
        raise SystemExit(143)

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with keep_sigterm():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what ray.init does, in effect
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)
