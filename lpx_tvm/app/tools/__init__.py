"""The commands' engines: the zoo, profile, compare, bench, design sweeps and plots."""
