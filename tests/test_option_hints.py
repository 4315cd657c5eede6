"""The hint to a misspelt option: a near miss in spelling, never an option of the opposite meaning."""

import pytest
from test_cli import assert_one_line_error, run

# (what was typed, the option of the opposite meaning that is near it in spelling): RELION's --no_norm is not a typo
# of --norm, nor its --strict_lowres_exp one of --strict_highres_exp
OPPOSITES = [("--no_norm", "--norm"), ("--no_scale", "--scale"), ("--ctf_uncorrected_ref", "--ctf_corrected_ref"),
             ("--join_random_halves", "--split_random_halves"), ("--strict_lowres_exp", "--strict_highres_exp")]


@pytest.mark.parametrize("typed, opposite", OPPOSITES, ids=[typed for typed, _ in OPPOSITES])
def test_an_option_of_the_opposite_meaning_is_never_suggested(capsys, tmp_path, typed, opposite):
    for command in ("refine", "classify"):
        code, _, err = run(capsys, command, "--i", str(tmp_path / "p.star"), typed)
        assert_one_line_error(code, err, f"No such option: {typed}", f"see `cryorefine {command} --help`")
        assert "Did you mean" not in err and opposite not in err.replace(typed, "")


def test_a_typo_still_gets_its_hint(capsys, tmp_path):
    """The rule leaves the hints to real typos as they were (--partcle_diameter's wording unchanged)."""
    code, _, err = run(capsys, "refine", "--i", str(tmp_path / "p.star"), "--partcle_diameter", "200")
    assert_one_line_error(code, err, "No such option: --partcle_diameter. Did you mean --particle_diameter? "
                                     "(see `cryorefine refine --help`)")
    assert "not implemented" not in err
    code, _, err = run(capsys, "classify", "--i", str(tmp_path / "p.star"), "--healpix_ordr", "3")
    assert_one_line_error(code, err, "Did you mean --healpix_order?")


@pytest.mark.parametrize("typed, option, opposite", [
    *((typed, option, True) for typed, option in OPPOSITES),
    ("--dont_combine_weights_via_disc", "--combine_weights_via_disc", True),
    ("--skip_align", "--align", True),
    ("--ini_low", "--ini_high", True),
    ("--partcle_diameter", "--particle_diameter", False),
    ("--healpix_ordr", "--healpix_order", False),
    ("--no_norm", "--no_nrom", False),  # both negated: a typo
    ("--flaten_solvent", "--flatten_solvent", False),
    ("--in_plane", "--plane", False),  # `in` alone is no negating prefix: a word of its own
])
def test_the_rule(typed, option, opposite):
    from cryorefine.cli import opposite_meaning

    assert opposite_meaning(typed, option) is opposite
    assert opposite_meaning(option, typed) is opposite
