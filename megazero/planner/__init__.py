"""Know before you launch: per-rank memory, step time and layout search from a MegazeroConfig.

The model-state bytes replay the ZeRO engine's own allocation (:mod:`.model_states`) on the
run's real parameter shapes (:mod:`.shapes`), so estimate and run time agree byte for byte.
"""
