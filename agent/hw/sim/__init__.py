"""The simulator, a product feature: a fake ``pynvml`` (:mod:`.nvml`), the GPU catalogue
(:mod:`.catalogue`), the machine-spec schema (:mod:`.spec`), the fake sysfs tree
(:mod:`.sysfs_tree`), the built-in machines (:mod:`.machines`) and the spec of a pasted
matrix (:mod:`.from_facts`). It may import :mod:`agent.records` and :mod:`agent.hw`."""
