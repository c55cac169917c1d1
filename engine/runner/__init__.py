"""The model runner: one step of a SchedulerOutput in, sampled tokens out (native C step or torch path)."""
