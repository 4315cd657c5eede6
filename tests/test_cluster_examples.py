"""examples/cluster: RELION's queue-submission template runs the GUI's relion_refine_mpi line as cryorefine."""

import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

TEMPLATE = REPO / "examples" / "cluster" / "relion_queue_template.sh"
# RELION 4's GUI lines (the tutorial's Refine3D job019 and Class3D job016, tests/jobs/test_relion_command_lines.py)
REFINE_LINE = (
    '`which relion_refine_mpi` --o Refine3D/job019/run --auto_refine --split_random_halves --i '
    'Extract/job018/particles.star --ref Class3D/job016/run_it025_class004_box256.mrc --firstiter_cc --ini_high 50 '
    '--dont_combine_weights_via_disc --scratch_dir /ssd/scheres --pool 3 --pad 2  --skip_gridding  '
    '--ctf --particle_diameter 200 --flatten_solvent --zero_mask --sym D2 --norm --scale  --j 6 --gpu "4:5:6:7"  '
    '--pipeline_control Refine3D/job019/')
CLASS3D_LINE = (
    '`which relion_refine_mpi` --o Class3D/job016/run --i Select/job014/particles.star --ref '
    'InitialModel/job015/initial_model.mrc --ini_high 50 --dont_combine_weights_via_disc --preread_images  --pool 30 '
    '--pad 2  --skip_gridding  --ctf --iter 25 --tau2_fudge 4 --particle_diameter 200 --K 4 --flatten_solvent '
    '--zero_mask --sym C1 --norm --scale  --j 6 --gpu ""  --pipeline_control Class3D/job016/')
# what RELION's GUI puts for the template's variables (gui_jobwindow / pipeline_jobs: the Running tab)
VARIABLES = {"XXXnameXXX": "Class3D/job016/", "XXXqueueXXX": "gpu", "XXXmpinodesXXX": "5", "XXXthreadsXXX": "6",
             "XXXextra1XXX": "4", "XXXoutfileXXX": "run.out", "XXXerrfileXXX": "run.err"}


def submitted(tmp_path, line):
    """The template filled in as RELION fills it for `line` and run with a launcher that prints its arguments."""
    text = TEMPLATE.read_text()
    for name, value in {**VARIABLES, "XXXcommandXXX": line}.items():
        text = text.replace(name, value)
    assert not re.search(r"XXX\w+XXX", text)  # every variable the template uses is one RELION fills in
    script = tmp_path / "job.sh"
    script.write_text(text)
    launcher = tmp_path / "launcher.py"
    launcher.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    env = {"PATH": "/usr/bin:/bin", "CRYOREFINE_MPIRUN": f"{sys.executable} {launcher}", "CRYOREFINE": "cryorefine"}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("line, job", [(REFINE_LINE, "refine"), (CLASS3D_LINE, "classify")])
def test_the_queue_template_runs_relion_s_line_as_the_matching_cryorefine_job(tmp_path, line, job):
    """The line goes to `cryorefine relion_refine` as it is, which runs it as the job RELION would run."""
    from cryorefine.cli import relion_refine_command

    args = submitted(tmp_path, line)
    relion_words = shlex.split(line)[2:]  # without `which relion_refine_mpi`
    assert args == ["-n", "5", "cryorefine", "relion_refine", *relion_words]
    assert relion_refine_command(args[4:]) == job


def test_a_path_to_relion_refine_mpi_is_dropped(tmp_path):
    """Where RELION is installed on the nodes, `which relion_refine_mpi` gives its path: not an argument."""
    fake = tmp_path / "bin"
    fake.mkdir()
    args = submitted(tmp_path, CLASS3D_LINE.replace("`which relion_refine_mpi`", str(fake / "relion_refine_mpi")))
    assert args[:4] == ["-n", "5", "cryorefine", "relion_refine"] and args[4] == "--o"
