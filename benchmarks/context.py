"""What the benchmarks of one ``python -m benchmarks`` run share: the mode, and one warm kernel.

The step-time, logging and warm-cell benchmarks use the same kernel (with nbfsdp loaded, so the dashboard
is on in each cell) to save the engines' start-up; the cold-start, transfer and GPU benchmarks start fresh
kernels of their own. Kernels here get ``NBFSDP_PREWARM=0`` unless the point is the pre-start, and every
benchmark but ``gpu`` hides GPUs (``CUDA_VISIBLE_DEVICES=""``) from its kernels and torchrun worlds, so that
on a GPU machine too both sides of a CPU comparison run on the CPU with gloo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.kernel import Kernel

#: Kernels whose benchmark is not about nbfsdp's background start.
NO_PREWARM = {"NBFSDP_PREWARM": "0"}
#: The CPU benchmarks' kernels and torchrun worlds.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@dataclass
class Context:
    quick: bool
    leftovers: list[str] = field(default_factory=list)
    """Processes a kernel left running after its shutdown (should stay empty)."""
    _warm: Kernel | None = None

    def warm_kernel(self) -> Kernel:
        """The shared kernel, started on first use, with nbfsdp loaded."""
        if self._warm is None:
            self._warm = Kernel(env={**NO_PREWARM, **CPU_ONLY})
            self._warm.execute("%load_ext nbfsdp")
        return self._warm

    def close_warm_kernel(self) -> None:
        if self._warm is not None:
            self.leftovers += self._warm.shutdown()
            self._warm = None

    def shutdown(self, kernel: Kernel) -> None:
        """Shut a benchmark's own kernel down, noting anything it left behind."""
        self.leftovers += kernel.shutdown()

    def rounds(self, full: int, quick: int) -> int:
        return quick if self.quick else full
