"""The method registry: names -> (scorer, schedule, allocators, knobs) -> a ready cache."""
