"""Discrete-event cluster simulator: the real scheduler, router and scaling decision, a cost model for the GPU.

See docs/simulator.md. Entry point: `python -m loadtests.sim --help`.
"""

from loadtests.sim.costmodel import CostModel
from loadtests.sim.simulator import SimConfig, SimResult, Simulator, simulate

__all__ = ["CostModel", "SimConfig", "SimResult", "Simulator", "simulate"]
