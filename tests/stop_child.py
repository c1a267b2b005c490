"""``usaf`` whose ``RANK``-th rank gets a stop request at its ``N``-th stop check, as if Ctrl-C had reached that rank
alone: the ranks must agree on it at that check. Run under torchrun by tests/test_distributed.py:

    python -m torch.distributed.run ... tests/stop_child.py RANK N score --model ...
"""

from __future__ import annotations

import os
import signal
import sys

from usaf.cli.app import main
from usaf.stages.stop import StopRequest

if __name__ == "__main__":
    stopping_rank, at = int(sys.argv[1]), int(sys.argv[2])
    real_check = StopRequest.check
    calls = [0]

    def check(self: StopRequest, **how) -> None:
        calls[0] += 1
        if calls[0] == at and int(os.environ.get("RANK", "0")) == stopping_rank:
            self.signum = signal.SIGINT  # what the handler does with a Ctrl-C
        real_check(self, **how)

    StopRequest.check = check
    sys.argv = ["usaf", *sys.argv[3:]]
    main()
