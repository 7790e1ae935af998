"""Jobs: --shape parsing and TOML jobs files, with one clear error per mistake."""

import pytest

from tvmfuse.errors import JobError
from tvmfuse.jobs import Job, load_jobs, parse_shape, parse_tolerance


def test_parse_shape_forms():
    assert parse_shape("x=1,128,768") == ("x", [1, 128, 768])
    assert parse_shape("x=1x128") == ("x", [1, 128])
    assert parse_shape("seq=128") == ("seq", [128])
    for bad in ("x", "x=", "=3", "x=1,,2", "x=-1"):
        with pytest.raises(JobError, match="expected NAME=DIMS"):
            parse_shape(bad)


def test_jobs_file(tmp_path):
    (tmp_path / "jobs.toml").write_text(
        'trials = 8\n[[model]]\npath = "a.onnx"\nshapes = { x = [1, 64], seq = 32 }\n'
        '[[model]]\nname = "b2"\npath = "sub/b.onnx"\ntrials = 0\n')
    a, b = load_jobs(str(tmp_path / "jobs.toml"))
    assert (a.name, a.trials, a.shapes) == ("a", 8, {"x": [1, 64], "seq": [32]})
    assert (b.name, b.trials, b.path) == ("b2", 0, str(tmp_path / "sub" / "b.onnx"))


@pytest.mark.parametrize("text, message", [
    ('[[model]]\npath = "a.onnx"\nshape = {}\n', "unknown key 'shape' (did you mean 'shapes'?)"),
    ('[[modle]]\npath = "a.onnx"\n', "unknown key 'modle' (did you mean 'model'?)"),
    ('[[model]]\nname = "x"\n', "has no 'path'"),
    ('[[model]]\npath = "a.onnx"\ntrials = -1\n', "'trials' must be a non-negative integer"),
    ('[[model]]\npath = "a.onnx"\n[[model]]\npath = "a.onnx"\n', "duplicate name 'a'"),
    ('[[model]]\npath = "a.onnx"\ndtype = "int4"\n', "dtype 'int4' is not supported"),
    ('[[model]]\npath = "a.onnx"\ndtype = "bf16"\nio_dtype = "fp16"\n',
     "io_dtype float16 does not fit compute dtype bfloat16"),
    ('io_dtype = "fp16"\n[[model]]\npath = "a.onnx"\n',
     "model #1: io_dtype float16 does not fit compute dtype float32"),
    ('[[model]]\npath = "a.onnx"\nshapes = { x = [0] }\n', "'shapes' must map names"),
    ('[[model]\n', "not valid TOML"),
    ('[[model]]\nname = "../../etc/x"\npath = "a.onnx"\n', "not a path"),
    ('[[model]]\npath = "a.onnx"\ntolerance = 0.02\n',
     "model #1: tolerance 0.02: expected ATOL,RTOL (two numbers), e.g. tolerance = [0.02, 0.02]"),
    ('[[model]]\npath = "a.onnx"\ntolerance = [0.02]\n', "model #1: tolerance [0.02]: expected ATOL,RTOL"),
    ('[[model]]\npath = "a.onnx"\ntolerance = [0.02, 0.02, 0.02]\n', "tolerance [0.02, 0.02, 0.02]: expected"),
    ('[[model]]\npath = "a.onnx"\ntolerance = ["0.02", "0.02"]\n', "tolerance ['0.02', '0.02']: expected"),
    ('[[model]]\npath = "a.onnx"\ntolerance = [true, 0.1]\n', "tolerance [True, 0.1]: expected"),
    ('[[model]]\npath = "a.onnx"\ntolerance = [-0.1, 0.1]\n', "tolerance [-0.1, 0.1]: atol -0.1 must be a finite"),
    ('[[model]]\npath = "a.onnx"\ntolerance = [0.1, nan]\n', "rtol nan must be a finite number >= 0"),
    ('tolerance = [inf, 0]\n[[model]]\npath = "a.onnx"\n', "top level: tolerance [inf, 0]: atol inf must be"),
    ('[[model]]\npath = "a.onnx"\ntolerence = [0.1, 0.1]\n', "unknown key 'tolerence' (did you mean 'tolerance'?)"),
])
def test_bad_jobs_files(tmp_path, text, message):
    path = tmp_path / "jobs.toml"
    path.write_text(text)
    with pytest.raises(JobError) as err:
        load_jobs(str(path))
    assert message in str(err.value) and str(path) in str(err.value)


def test_jobs_file_io_dtype(tmp_path):
    """io_dtype: top level or per model, fp32 or the model's compute dtype; the command line's is the default."""
    path = tmp_path / "jobs.toml"
    path.write_text('dtype = "fp16"\nio_dtype = "fp16"\n[[model]]\npath = "a.onnx"\n'
                    '[[model]]\npath = "b.onnx"\nio_dtype = "fp32"\n[[model]]\npath = "c.onnx"\ndtype = "bf16"\n'
                    'io_dtype = "bf16"\n')
    assert [(j.dtype, j.io_dtype) for j in load_jobs(str(path))] == \
        [("float16", "float16"), ("float16", "float32"), ("bfloat16", "bfloat16")]
    path.write_text('[[model]]\npath = "a.onnx"\n')
    assert load_jobs(str(path), dtype="float16", io_dtype="float16")[0].io_dtype == "float16"
    assert load_jobs(str(path))[0].io_dtype == "float32"


def test_job_names_its_dtype_the_way_the_verifier_keys_tolerances():
    """A library caller's Job(dtype="fp16") verifies with the fp16 tolerance, not fp32's (bench/model_builds.py)."""
    from tvmfuse.errors import JobError
    from tvmfuse.jobs import Job
    assert Job("m", None, dtype="fp16").dtype == "float16"
    with pytest.raises(JobError, match="fp8"):
        Job("m", None, dtype="fp8")


def test_parse_tolerance_good_values():
    assert parse_tolerance("0.02,0.02") == (0.02, 0.02)
    assert parse_tolerance(" 1e-3 , 0 ") == (0.001, 0.0)
    assert parse_tolerance([0, 1]) == (0.0, 1.0) and parse_tolerance((0.5, 0.25)) == (0.5, 0.25)
    assert all(isinstance(v, float) for v in parse_tolerance([0, 1]))


@pytest.mark.parametrize("text, message", [
    ("0.02", "--tolerance '0.02': expected ATOL,RTOL (two numbers), e.g. --tolerance 0.02,0.02"),
    ("0.02,0.02,0.02", "--tolerance '0.02,0.02,0.02': expected ATOL,RTOL"),
    ("a,b", "--tolerance 'a,b': expected ATOL,RTOL"),
    ("0.02,", "--tolerance '0.02,': expected ATOL,RTOL"),
    ("", "--tolerance '': expected ATOL,RTOL"),
    ("-1,0", "--tolerance '-1,0': atol -1 must be a finite number >= 0"),
    ("0,-0.5", "--tolerance '0,-0.5': rtol -0.5 must be a finite number >= 0"),
    ("nan,0", "--tolerance 'nan,0': atol nan must be a finite number >= 0"),
    ("0,inf", "--tolerance '0,inf': rtol inf must be a finite number >= 0"),
])
def test_parse_tolerance_bad_values(text, message):
    with pytest.raises(JobError) as err:
        parse_tolerance(text)
    assert str(err.value).startswith(message)


def test_jobs_file_tolerance(tmp_path):
    """tolerance: per model, then the top level, then the command line's; none: None (the dtype defaults)."""
    path = tmp_path / "jobs.toml"
    path.write_text('tolerance = [0.05, 0.01]\n[[model]]\npath = "a.onnx"\n'
                    '[[model]]\npath = "b.onnx"\ntolerance = [0, 0.2]\n')
    assert [j.tolerance for j in load_jobs(str(path), tolerance=(1.0, 1.0))] == [(0.05, 0.01), (0.0, 0.2)]
    path.write_text('[[model]]\npath = "a.onnx"\n')
    assert load_jobs(str(path))[0].tolerance is None
    assert load_jobs(str(path), tolerance=(0.03, 0.03))[0].tolerance == (0.03, 0.03)


def test_job_checks_a_library_callers_tolerance():
    assert Job("m", None).tolerance is None
    assert Job("m", None, tolerance=[0.1, 0]).tolerance == (0.1, 0.0)
    with pytest.raises(JobError, match="tolerance 'x'"):
        Job("m", None, tolerance="x")


def test_jobs_file_kv_cache_and_max_seq(tmp_path):
    (tmp_path / "jobs.toml").write_text('[[model]]\npath = "a.onnx"\nmax_seq = 1024\n'
                                        '[[model]]\npath = "b.onnx"\nkv_cache = "onnx"\n')
    a, b = load_jobs(str(tmp_path / "jobs.toml"))
    assert (a.kv_cache, a.max_seq, b.kv_cache, b.max_seq) == (None, 1024, "onnx", None)
    for bad, message in (('kv_cache = "paged"', "'kv_cache' must be"), ("max_seq = 0", "'max_seq' must be")):
        (tmp_path / "bad.toml").write_text(f'[[model]]\npath = "a.onnx"\n{bad}\n')
        with pytest.raises(JobError, match=message):
            load_jobs(str(tmp_path / "bad.toml"))
