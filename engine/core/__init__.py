"""The engine core: sequences, paged blocks, the scheduler (schedule -> update) and the requests it serves."""
