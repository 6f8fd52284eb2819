"""The parts of `bench_scale.py`: the simulated fleet (`fleet`), its ZMTP connections
(`zmtp`), the load generator (`generator`), the subscribers and view (`listeners`), what
is read from the registry (`registry_figures`), one measured run (`run`), the sync storm
(`storm`), the deadband simulation (`deadband`) and --profile (`profile`)."""
