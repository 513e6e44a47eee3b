"""megazero.planner.deepspeed_compat against DeepSpeed's own estimators.

``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py) and
``estimate_zero3_model_states_mem_needs`` (stage3.py) of DeepSpeed 0.19.8, every branch:
ZeRO-2 with and without ``cpu_offload`` (and ``additional_buffer_factor`` 1.5, the default,
and 1.0); ZeRO-3 with ``cpu_offload`` x ``cpu_offload_params`` x ``zero_init``. The tables are
DeepSpeed's return values for these inputs (GPT-2 124M, 1.3B, 6.7B and an odd size whose
divisions do not come out even), so the check runs without DeepSpeed; where DeepSpeed is
importable the same inputs are also sent to it live.
"""

from megazero.planner.deepspeed_compat import zero2_mem_needs, zero3_mem_needs

# (total_params, gpus_per_node, nodes, cpu_offload, additional_buffer_factor,
#  (host bytes, bytes per GPU)) from DeepSpeed 0.19.8
ZERO2 = [
    (124439808, 8, 1, True, 1.5, (5973110784, 248879616)),
    (124439808, 8, 1, True, 1.0, (3982073856, 248879616)),
    (124439808, 8, 1, False, 1.5, (5973110784, 528869184)),
    (124439808, 8, 1, False, 1.0, (3982073856, 528869184)),
    (1315758080, 8, 2, True, 1.5, (126312775680, 2631516160)),
    (1315758080, 8, 2, True, 1.0, (84208517120, 2631516160)),
    (1315758080, 8, 2, False, 1.5, (63156387840, 4111744000)),
    (1315758080, 8, 2, False, 1.0, (42104258560, 4111744000)),
    (6738415616, 4, 4, True, 1.5, (646887899136, 13476831232)),
    (6738415616, 4, 4, True, 1.0, (431258599424, 13476831232)),
    (6738415616, 4, 4, False, 1.5, (161721974784, 21057548800)),
    (6738415616, 4, 4, False, 1.0, (107814649856, 21057548800)),
    (1000003, 3, 1, True, 1.5, (24000072, 2000006)),
    (1000003, 3, 1, True, 1.0, (16000048, 2000006)),
    (1000003, 3, 1, False, 1.5, (18000054, 8000024)),
    (1000003, 3, 1, False, 1.0, (12000036, 8000024)),
]
# (total_params, largest_layer_params, gpus_per_node, nodes, cpu_offload, cpu_offload_params,
#  zero_init, additional_buffer_factor, (host bytes, bytes per GPU, largest layer bytes))
ZERO3 = [
    (124439808, 38597376, 8, 1, True, True, True, 1.5, (3359874816, 154389504, 154389504)),
    (124439808, 38597376, 8, 1, True, True, False, 1.5, (5973110784, 154389504, 154389504)),
    (124439808, 38597376, 8, 1, True, False, True, 1.5, (2986555392, 185499456, 154389504)),
    (124439808, 38597376, 8, 1, True, False, False, 1.5, (5973110784, 185499456, 154389504)),
    (124439808, 38597376, 8, 1, False, True, True, 1.5, (1852674048, 434379072, 154389504)),
    (124439808, 38597376, 8, 1, False, True, False, 1.5, (5973110784, 434379072, 154389504)),
    (124439808, 38597376, 8, 1, False, False, True, 1.5, (1852674048, 434379072, 154389504)),
    (124439808, 38597376, 8, 1, False, False, False, 1.5, (5973110784, 434379072, 154389504)),
    (1315758080, 102957056, 8, 2, True, True, True, 1.5, (17762734080, 411828224, 411828224)),
    (1315758080, 102957056, 8, 2, True, True, False, 1.5, (63156387840, 411828224, 411828224)),
    (1315758080, 102957056, 8, 2, True, False, True, 1.5, (15789096960, 576297984, 411828224)),
    (1315758080, 102957056, 8, 2, True, False, False, 1.5, (63156387840, 576297984, 411828224)),
    (1315758080, 102957056, 8, 2, False, True, True, 1.5, (4941938688, 1892056064, 411828224)),
    (1315758080, 102957056, 8, 2, False, True, False, 1.5, (63156387840, 1892056064, 411828224)),
    (1315758080, 102957056, 8, 2, False, False, True, 1.5, (4941938688, 1892056064, 411828224)),
    (1315758080, 102957056, 8, 2, False, False, False, 1.5, (63156387840, 1892056064, 411828224)),
    (6738415616, 131072000, 4, 4, True, True, True, 1.5, (45484305408, 524288000, 524288000)),
    (6738415616, 131072000, 4, 4, True, True, False, 1.5, (161721974784, 524288000, 524288000)),
    (6738415616, 131072000, 4, 4, True, False, True, 1.5, (40430493696, 1366589952, 524288000)),
    (6738415616, 131072000, 4, 4, True, False, False, 1.5, (161721974784, 1366589952, 524288000)),
    (6738415616, 131072000, 4, 4, False, True, True, 1.5, (3145728000, 8105005568, 524288000)),
    (6738415616, 131072000, 4, 4, False, True, False, 1.5, (161721974784, 8105005568, 524288000)),
    (6738415616, 131072000, 4, 4, False, False, True, 1.5, (3145728000, 8105005568, 524288000)),
    (6738415616, 131072000, 4, 4, False, False, False, 1.5, (161721974784, 8105005568, 524288000)),
    (1000003, 77777, 3, 1, True, True, True, 1.5, (27000081, 311108, 311108)),
    (1000003, 77777, 3, 1, True, True, False, 1.5, (27000081, 311108, 311108)),
    (1000003, 77777, 3, 1, True, False, True, 1.5, (24000072, 977776, 311108)),
    (1000003, 77777, 3, 1, True, False, False, 1.5, (24000072, 977776, 311108)),
    (1000003, 77777, 3, 1, False, True, True, 1.5, (1399986, 6311126, 311108)),
    (1000003, 77777, 3, 1, False, True, False, 1.5, (18000054, 6311126, 311108)),
    (1000003, 77777, 3, 1, False, False, True, 1.5, (1399986, 6311126, 311108)),
    (1000003, 77777, 3, 1, False, False, False, 1.5, (18000054, 6311126, 311108)),
]


def check_zero2(z2=None):
    for total, gpn, nodes, off, abf, expected in ZERO2:
        ours = zero2_mem_needs(total, gpn, nodes, off, abf)
        assert ours == expected, (total, gpn, nodes, off, abf, ours)
        if z2 is not None:
            assert ours == tuple(z2(total, gpn, nodes, off, abf))


def check_zero3(z3=None):
    for total, largest, gpn, nodes, off, offp, zi, abf, expected in ZERO3:
        ours = zero3_mem_needs(total, largest, gpn, nodes, off, offp, zi, abf)
        assert ours == expected, (total, largest, gpn, nodes, off, offp, zi, ours)
        if z3 is not None:
            assert ours == tuple(z3(total, largest, gpn, nodes, off, offp, zi, abf))


def test_zero2_equals_deepspeed_table():
    check_zero2()


def test_zero3_equals_deepspeed_table():
    check_zero3()


def test_default_buffer_factor_is_deepspeeds():
    assert zero2_mem_needs(10**6, 2, 1, True) == zero2_mem_needs(10**6, 2, 1, True, 1.5)
    assert zero3_mem_needs(10**6, 10**4, 2) == zero3_mem_needs(10**6, 10**4, 2, 1, True, True,
                                                               True, 1.5)


def test_equals_installed_deepspeed(monkeypatch):
    import pytest

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    check_zero2(estimate_zero2_model_states_mem_needs)
    check_zero3(estimate_zero3_model_states_mem_needs)


if __name__ == "__main__":  # run under a Python that has DeepSpeed but maybe not pytest
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    check_zero2(estimate_zero2_model_states_mem_needs)
    check_zero3(estimate_zero3_model_states_mem_needs)
    print(f"{len(ZERO2)} ZeRO-2 and {len(ZERO3)} ZeRO-3 cases equal DeepSpeed's")
