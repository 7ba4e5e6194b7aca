"""The GPU catalog: every row sourced and sane, names found exactly, unknown names refused."""

import dataclasses

import pytest

from devices import A100, H100, P100, T4, V100
from redline.errors import ConfigError
from redline.hardware.catalog import GPUSpec, find_gpu, load_catalog, names_whole, nearest_gpus, peak_tflops

CATALOG = load_catalog()
PEAKS = ("peak_tflops_fp32", "peak_tflops_tf32", "peak_tflops_bf16", "peak_tflops_fp16", "peak_tflops_fp8")


@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.id)
def test_every_row_is_sourced_and_sane(spec):
    assert spec.source.startswith("https://")
    assert spec.mem_gib > 0 and spec.mem_bw_gbs > 0
    assert spec.tdp_w is None or spec.tdp_w > 0
    for name in PEAKS:
        value = getattr(spec, name)
        assert value is None or value > 0, name
    # Tensor cores outrun the CUDA cores on every GPU that has them.
    for low, high in [("fp32", "tf32"), ("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp8"), ("tf32", "bf16")]:
        lo, hi = getattr(spec, f"peak_tflops_{low}"), getattr(spec, f"peak_tflops_{high}")
        if lo is not None and hi is not None:
            assert hi >= lo, f"{spec.id}: {high} {hi} < {low} {lo}"
    # bf16 tensor cores arrived with Ampere (sm80), TF32 too, FP8 with Ada and Hopper (sm89).
    if spec.compute_capability < (8, 0):
        assert spec.peak_tflops_bf16 is None and spec.peak_tflops_tf32 is None
    if spec.compute_capability < (8, 9):
        assert spec.peak_tflops_fp8 is None


@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.id)
def test_what_torch_reads_on_each_card_is_sourced_or_its_absence_explained(spec):
    # a card reads less than its datasheet's size (ECC, the driver's reserve): the memory a step is weighed against
    if spec.usable_gib is None:
        assert "usable_gib is left out" in spec.note
    else:
        assert spec.usable_gib < spec.mem_gib and spec.usable_source.startswith(("https://", "as ", "measured by"))
    assert spec.weighed_gib == (spec.usable_gib or spec.mem_gib)


def test_gddr_cards_lose_more_than_a_sixteenth_to_ecc_and_the_driver_and_hbm_cards_less():
    # ECC on GDDR keeps 1/16 of it (an L4's 24 GiB reads 22.03), where HBM holds its ECC apart (an H100's 80: 79.11)
    for gddr in ("l4", "t4", "a10", "a10g", "l40s", "rtx-6000-ada"):
        spec = next(s for s in CATALOG if s.id == gddr)
        assert spec.usable_gib is not None and spec.usable_gib < spec.mem_gib * 15 / 16, gddr
    assert H100_SXM.usable_gib is not None and H100_SXM.usable_gib > H100_SXM.mem_gib * 15 / 16


def test_the_catalog_is_read_once():
    assert load_catalog() is CATALOG


def test_dense_not_sparse_peaks():
    """The headline datasheet numbers (with sparsity) are twice these: H100 SXM 1979 -> 989.4."""
    assert find_gpu("NVIDIA H100 80GB HBM3").peak_tflops_bf16 == 989.4
    assert find_gpu("NVIDIA H100 PCIe").peak_tflops_bf16 == 756.0
    assert find_gpu("NVIDIA L4").peak_tflops_bf16 == 121.0
    # The NVL cards run lower clocks than the SXM parts: the sheet's 1,671 with sparsity, halved.
    assert find_gpu("NVIDIA H100 NVL").peak_tflops_bf16 == 835.5
    assert find_gpu("NVIDIA H200 NVL").peak_tflops_bf16 == 835.5
    assert find_gpu("NVIDIA H200").peak_tflops_bf16 == 989.0
    # B200: the sheet's TF32 2.2 PFLOPS is with sparsity; FP32 (CUDA cores) has none to halve.
    b200 = find_gpu("NVIDIA B200")
    assert (b200.peak_tflops_fp32, b200.peak_tflops_tf32, b200.peak_tflops_bf16) == (75.0, 1100.0, 2250.0)
    assert peak_tflops(b200, "fp32", tf32=True) == 1100.0 and peak_tflops(b200, "fp32", tf32=False) == 75.0
    # GeForce: the FP32-accumulate rate autocast uses, half the FP16-accumulate headline.
    assert find_gpu("NVIDIA GeForce RTX 4090").peak_tflops_bf16 == 165.2
    # AMD's MI300X: dense matrix rates, 192 GB of HBM3 (a wrong row here made MI350X MFU read 152%).
    mi300x = find_gpu("AMD Instinct MI300X")
    assert (mi300x.peak_tflops_bf16, mi300x.peak_tflops_tf32, mi300x.mem_gib) == (1307.4, 653.7, 192)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA B200", "b200"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA GH200 480GB", "gh200-96gb"),
        ("NVIDIA GH200 120GB", "gh200-96gb"),
        ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("AMD Instinct MI300X", "mi300x"),  # a ROCm build of torch names it so, as a "cuda" device
        ("AMD Instinct MI300X VF", "mi300x"),  # the whole card in a cloud VM (Azure's ND MI300X v5)
        ("NVIDIA A100-SXM-80GB", "a100-sxm4-80gb"),  # a driver's name for it, as MLPerf and collect_env log it
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"),
        ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
        ("nvidia  h100 80gb hbm3 ", "h100-sxm"),  # case and spacing do not matter
    ],
)
def test_torch_names_find_their_row(name, expected):
    spec = find_gpu(name)
    assert spec is not None and spec.id == expected


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA Foo 9000",
        "Quadro RTX 6000",  # the Turing card, not the Ada one
        "NVIDIA H200 NVL 2",
        "NVIDIA GH200",  # which memory: the name torch reports says
        "NVIDIA L40",  # not an L4, not an L40S
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "Tesla V100-FHHL-16GB",
        "",
    ],
)
def test_unknown_names_give_none_never_a_near_match(name):
    assert find_gpu(name) is None


def test_a_card_named_with_the_memory_it_reports_finds_its_row():
    from redline.hardware.catalog import gpus_named

    assert [s.id for s in gpus_named("t4 15gb")] == ["t4"]  # a 16 GB T4 reports 15 GiB: the driver keeps some
    assert [s.id for s in gpus_named("a100 80gb")] == ["a100-sxm4-80gb", "a100-pcie-80gb"]
    assert gpus_named("t4 12gb") == [] and gpus_named("a100 60gb") == []  # more than a tenth off is another card
    assert [s.id for s in gpus_named("T4 16 GB")] == ["t4"], "a size typed with a space is still the memory"
    assert [s.id for s in gpus_named("NVIDIA H200 141GB")] == ["h200-sxm"], "torch's name for it, with its memory"
    assert names_whole("NVIDIA H200 141GB", gpus_named("NVIDIA H200 141GB")[0])


def test_a_word_that_starts_a_row_term_finds_it_but_a_card_number_never_another():
    from redline.hardware.catalog import gpus_named

    assert [s.id for s in gpus_named("A100 SXM")] == ["a100-sxm4-80gb", "a100-sxm4-40gb"]  # sxm of sxm4
    assert [s.id for s in gpus_named("a10")] == ["a10"], "a10 is a card, not the start of a100"


def test_the_nearest_rows_put_the_card_named_first_where_its_memory_is_off():
    assert nearest_gpus("B200 192GB")[0].id == "b200"  # the catalog's B200 has 180 GB


def test_a_card_one_letter_off_a_family_of_rows_names_that_family():
    # "h900" named none: its ids ("h100-sxm", "h200-nvl") read too far from four letters
    assert {spec.id.split("-")[0] for spec in nearest_gpus("h900")} <= {"h100", "h200"}
    assert nearest_gpus("h900")
    assert [spec.id for spec in nearest_gpus("l40")] == ["l40s", "l4"]


def test_catalog_agrees_with_the_test_devices():
    for facts in (H100, A100, V100, T4):
        spec = find_gpu(facts.name)
        assert spec is not None and spec.compute_capability == facts.capability
    assert find_gpu(P100.name) is None


def spec(**changes):
    base = dict(id="x", name="X", architecture="Test", compute_capability=(9, 0), match=("X",), mem_gib=1, mem_bw_gbs=1)
    return GPUSpec(**{**base, "source": "https://example.com/x", **changes})


def test_the_most_specific_pattern_wins_and_a_tie_gives_none():
    broad = spec(id="broad", match=("NVIDIA H100*",))
    narrow = spec(id="narrow", match=("NVIDIA H100 PCIe*",))
    rows = [broad, narrow]
    assert find_gpu("NVIDIA H100 PCIe", catalog=rows) is narrow
    assert find_gpu("NVIDIA H100 NVL", catalog=rows) is broad
    assert find_gpu("NVIDIA A100", catalog=rows) is None
    twin = spec(id="twin", match=("NVIDIA H100 *",))
    assert find_gpu("NVIDIA H100 NVL", catalog=[twin, spec(id="other", match=("NVIDIA H100*L",))]) is None


H100_SXM = find_gpu("NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize(
    ("gpu", "precision", "tf32", "expected"),
    [
        (H100_SXM, "fp32", False, 66.9),
        (H100_SXM, "fp32", True, 494.7),
        (H100_SXM, "bf16-mixed", False, 989.4),
        (H100_SXM, "bf16-mixed", True, 989.4),
        (H100_SXM, "fp16-mixed", False, 989.4),
        (find_gpu("Tesla T4"), "fp16-mixed", False, 65.0),
        (find_gpu("Tesla T4"), "bf16-mixed", False, None),  # Turing has no bf16
        (find_gpu("Tesla T4"), "fp32", True, None),  # nor TF32: no peak rather than the fp32 one
        (find_gpu("NVIDIA A10G"), "bf16-mixed", False, None),  # disputed figure left out
        (None, "bf16-mixed", False, None),  # unknown GPU
    ],
)
def test_peak_tflops_picks_the_field_of_the_precision(gpu, precision, tf32, expected):
    assert peak_tflops(gpu, precision, tf32=tf32) == expected


def test_peak_tflops_rejects_an_unknown_precision():
    with pytest.raises(ConfigError, match=r"precision='bf16'.*'bf16-mixed'"):
        peak_tflops(H100_SXM, "bf16", tf32=False)


GOOD_ROW = """
[[gpu]]
id = "good"
name = "Good GPU"
architecture = "Hopper"
compute_capability = [9, 0]
match = ["NVIDIA Good"]
peak_tflops_bf16 = 100.0
mem_gib = 80
mem_bw_gbs = 3350
tdp_w = 700
source = "https://example.com/good.pdf"
"""


def write(tmp_path, text):
    path = tmp_path / "catalog.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_catalog_file_loads(tmp_path):
    (row,) = load_catalog(write(tmp_path, GOOD_ROW))
    assert row.id == "good" and row.compute_capability == (9, 0) and row.match == ("NVIDIA Good",)
    assert find_gpu("nvidia good", catalog=[row]) == row


def test_a_row_takes_the_reading_of_a_row_with_the_same_memory_only_while_the_two_agree(tmp_path):
    read = GOOD_ROW.replace("tdp_w = 700", 'usable_gib = 79.1\nusable_source = "https://example.com/oom"')
    twin = read.replace('id = "good"', 'id = "twin"').replace("NVIDIA Good", "NVIDIA Twin")
    twin = twin.replace("https://example.com/oom", "as good: the same chip and memory")
    good, taken = load_catalog(write(tmp_path, read + twin))
    assert taken.weighed_gib == good.weighed_gib == 79.1
    drifted = twin.replace("usable_gib = 79.1", "usable_gib = 79.5")  # the lender's figure corrected, this one not
    with pytest.raises(ConfigError, match=r"row 'twin' takes usable_gib 79.5 'as good', which is no row reading"):
        load_catalog(write(tmp_path, read + drifted))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("peak_tflops_bf16 = 100.0", "peak_tflops_bf16 = -100.0"), r"row 2 \(id='bad'\): peak_tflops_bf16=-100.0"),
        (("peak_tflops_bf16 = 100.0", 'peak_tflops_bf16 = "100"'), r"row 2 \(id='bad'\): peak_tflops_bf16='100'"),
        (("tdp_w = 700", "tdp_w = true"), r"row 2 \(id='bad'\): tdp_w=True"),
        (("peak_tflops_bf16", "peak_tflops_bf61"), r"row 2 \(id='bad'\): unknown field 'peak_tflops_bf61'"),
        (('source = "https://example.com/good.pdf"', ""), r"row 2 \(id='bad'\): field 'source' is missing"),
        (("https://example.com", "http://example.com"), r"row 2 \(id='bad'\): source='http://"),
        (("compute_capability = [9, 0]", "compute_capability = [9]"), r"row 2 \(id='bad'\): compute_capability"),
        (('match = ["NVIDIA Good"]', "match = []"), r"row 2 \(id='bad'\): match=\(\)"),
        (('match = ["NVIDIA Good"]', 'match = ["nvidia  GOOD"]'), r"'nvidia  GOOD' is in rows 'good' and 'bad'"),
        (("tdp_w = 700", 'usable_gib = 81.0\nusable_source = "https://example.com/oom"'),
         r"row 2 \(id='bad'\): usable_gib=81.0 is not allowed; expected a positive number no larger than mem_gib"),
        (("tdp_w = 700", "usable_gib = 79.1"), r"row 2 \(id='bad'\): usable_source='' .*given with it"),
        (("tdp_w = 700", 'usable_source = "https://example.com/oom"'), r"usable_source='https://example.com/oom'"),
        (('match = ["NVIDIA Good"]', 'match = ["NVIDIA Bad"]\nusable_gib = 79.1\nusable_source = "as good: the same"'),
         r"row 'bad' takes usable_gib 79.1 'as good', which is no row reading the same mem_gib and usable_gib"),
    ],
)  # fmt: skip
def test_a_malformed_row_names_the_row_and_the_field(tmp_path, edit, message):
    bad = GOOD_ROW.replace('id = "good"', 'id = "bad"').replace(*edit)
    with pytest.raises(ConfigError, match=message):
        load_catalog(write(tmp_path, GOOD_ROW + bad))


def test_a_file_that_is_not_a_catalog_says_so(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_catalog(write(tmp_path, "[[gpu]\n"))
    with pytest.raises(ConfigError, match=r"no \[\[gpu\]\] rows"):
        load_catalog(write(tmp_path, 'title = "empty"\n'))


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        H100_SXM.mem_gib = 1  # type: ignore[misc]
