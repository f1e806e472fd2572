"""tide's planner: from a trace and a hardware profile, decide where every chunk and activation
lives at every moment, and write it down as a schedule (DESIGN.md §4). Never imports torch."""

__version__ = "0.1.0"
