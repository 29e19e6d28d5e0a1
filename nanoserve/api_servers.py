"""ApiServers: ``nanoserve frontend --api-servers N`` keeps N frontend processes on one port.

With N above 1 the command becomes this small manager. It starts N ``nanoserve frontend``
children with its own options in their environment, each told which one it is by
``NANOSERVE_API_SERVER_INDEX``; each binds the port with SO_REUSEPORT, loads its own tokenizer
and connects to the one scheduler on its own socket. Every child runs under a ``Supervisor``
(nanoserve/supervisor.py) in a thread of the manager:

- a child that crashes or is killed is restarted with backoff; only its own requests were lost
  (the scheduler aborts the requests of a frontend whose connection closed);
- SIGTERM or SIGINT to the manager goes to every child, which drains; the manager then exits
  with the worst of their statuses;
- a child that exits on its own with 0 or 2 (a usage error, such as a port another program
  holds) stops the others, and the manager exits with that child's status;
- the children get SIGKILL if the manager dies, so none is left holding the port.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading

from nanoserve.supervisor import Supervisor, SupervisorConfig

INDEX_VARIABLE = "NANOSERVE_API_SERVER_INDEX"


def frontend_command() -> tuple[str, ...]:
    """The command line of one frontend child."""
    return (sys.executable, "-m", "nanoserve.cli", "frontend")


class ApiServers:
    """Supervises ``count`` frontend children until they end."""

    def __init__(
        self,
        count: int,
        environment: dict[str, str],
        command: tuple[str, ...] | None = None,
        initial_backoff: float = 0.5,
    ) -> None:
        if count < 2:
            raise ValueError(f"a manager needs at least 2 frontends, got {count}")
        self.supervisors = [
            Supervisor(
                SupervisorConfig(
                    command=command or frontend_command(),
                    initial_backoff=initial_backoff,
                    env={**environment, INDEX_VARIABLE: str(index)},
                    label=f"frontend {index + 1} of {count}",
                    die_with_parent=True,
                )
            )
            for index in range(count)
        ]
        self._ended: queue.Queue[tuple[int, int]] = queue.Queue()  # (index, exit status)
        self._stopping = False

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop every child (main thread only)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda received, _frame: self.stop(received))

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to every child and restart none of them again."""
        self._stopping = True
        for supervisor in self.supervisors:
            supervisor.forward(signum)

    def run(self) -> int:
        """Start the children and wait for all of them; returns the manager's exit status."""
        for index, supervisor in enumerate(self.supervisors):
            thread = threading.Thread(
                target=self._supervise, args=(index, supervisor), name=f"frontend-{index}"
            )
            thread.start()
        statuses: list[int] = []
        first_unasked: int | None = None
        while len(statuses) < len(self.supervisors):
            try:
                # A timeout, so that a signal's handler runs while the main thread waits.
                _, status = self._ended.get(timeout=0.5)
            except queue.Empty:
                continue
            statuses.append(status)
            if not self._stopping:  # a child gave up on its own: end the others too
                first_unasked = status
                self.stop()
        return first_unasked if first_unasked is not None else max(statuses)

    def _supervise(self, index: int, supervisor: Supervisor) -> None:
        status = 1
        try:
            status = supervisor.run()
        finally:
            self._ended.put((index, status))
