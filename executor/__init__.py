"""tide's executor: record a trace of one iteration, and replay a schedule inside an ordinary
PyTorch training loop (DESIGN.md §5). Never imports planner."""
