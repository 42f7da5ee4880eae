"""Imported by Python at the start of every process whose PYTHONPATH holds this folder (tests.helpers.held_env
puts it there for a test's trainer subprocesses). With SYMGPT_TEST_HOLD_AFTER_STEP=K in the environment, a trainer
holds after the K-th step it runs (step K of a new run), before it asks whether to stop, until SIGINT or SIGTERM
arrives: it prints `held after step K (rank R)` and waits (at most 5 minutes). A test then signals a run whose
position it knows, so the step a run stops at is exact, not a matter of how many steps fit between a printed line
and the signal. With SYMGPT_TEST_HOLD_SIGNALS=N it holds until its stop request has taken N signals, printing
`signal n taken` after each (a test sends the next one after that line). Without the variables nothing is imported
or changed."""
import os

HOLD = os.environ.get("SYMGPT_TEST_HOLD_AFTER_STEP")
if HOLD:
    import time

    from run.stop import StopRequest

    agreed, handle, calls, taken = StopRequest.agreed, StopRequest._handle, [0], [0]
    wanted = int(os.environ.get("SYMGPT_TEST_HOLD_SIGNALS", "1"))

    def counted(self: StopRequest, signum: int, frame) -> None:
        """StopRequest's handler, counting the signals it takes."""
        handle(self, signum, frame)
        taken[0] += 1
        os.write(1, f"signal {taken[0]} taken\n".encode())

    def held(self: StopRequest) -> int:
        """StopRequest.agreed, called once per step: after step HOLD, first wait for the signals."""
        calls[0] += 1
        if calls[0] == int(HOLD):
            # one write of the whole line: under torchrun the ranks share the pipe, and print's two writes interleave
            os.write(1, f"held after step {HOLD} (rank {os.environ.get('RANK', '0')})\n".encode())
            deadline = time.monotonic() + 300
            while not self.signum or taken[0] < wanted:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"held after step {HOLD}: {wanted} signals did not come within 300 s")
                time.sleep(0.02)
        return agreed(self)

    StopRequest.agreed, StopRequest._handle = held, counted
