import numpy as np
import pytest

from cryorefine.report import angular_histogram, write_iteration_report


def report_args(tilt):
    rng = np.random.default_rng(0)
    return dict(iteration=3, fsc=np.linspace(1, 0, 17), ori_size_px=32, pixel_size_angstrom=2.0,
                resolution_angstrom=8.0, rot_deg=rng.uniform(-180, 180, 500), tilt_deg=np.full(500, tilt),
                timings_seconds={"expectation": 10.0, "maximization": 1.5, "write": 0.2})


def test_png_is_written(tmp_path):
    import matplotlib.image

    write_iteration_report(tmp_path / "run_it003_report.png", **report_args(10.0))
    raw = (tmp_path / "run_it003_report.png").read_bytes()
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    image = matplotlib.image.imread(tmp_path / "run_it003_report.png")
    assert image.shape[:2] == (360, 1200)


def test_angular_panel_follows_the_data(tmp_path):
    import matplotlib.image

    write_iteration_report(tmp_path / "a.png", **report_args(10.0))
    write_iteration_report(tmp_path / "b.png", **report_args(170.0))
    a = matplotlib.image.imread(tmp_path / "a.png")
    b = matplotlib.image.imread(tmp_path / "b.png")
    middle = slice(480, 900)  # the angular panel's columns
    assert np.abs(a[:, middle] - b[:, middle]).max() > 0.1


def test_angular_histogram_bins():
    counts = angular_histogram([-179.0, 0.0, 0.0, 179.0, 181.0], [5.0, 95.0, 95.0, 175.0, 5.0], bins=(4, 2))
    assert counts.shape == (2, 4)
    assert counts.sum() == 5
    assert counts[1, 2] == 2  # tilt 95°, rot 0° -> upper row, third column
    assert counts[0, 0] == 2  # rot −179° and rot 181° (= −179°) at tilt 5°
    assert counts[1, 3] == 1


def test_nothing_left_behind_on_failure(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def fail(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", fail)
    with pytest.raises(OSError):
        write_iteration_report(tmp_path / "r.png", **report_args(10.0))
    assert list(tmp_path.iterdir()) == []


def test_classification_report_follows_the_class_distribution(tmp_path):
    import matplotlib.image

    from cryorefine.report import write_classification_report

    def draw(name, history):
        rng = np.random.default_rng(1)
        write_classification_report(tmp_path / name, iteration=len(history), class_distributions=history,
                                    ssnr=np.vstack([np.geomspace(100, 0.01, 17)] * 2), ori_size_px=32,
                                    pixel_size_angstrom=2.0, resolution_angstrom=8.0,
                                    rot_deg=rng.uniform(-180, 180, 100), tilt_deg=rng.uniform(0, 180, 100),
                                    timings_seconds={"expectation": 1.0})
        return matplotlib.image.imread(tmp_path / name)

    even = draw("even.png", [[0.5, 0.5], [0.5, 0.5]])
    skewed = draw("skewed.png", [[0.5, 0.5], [0.9, 0.1]])
    assert even.shape == skewed.shape
    left = slice(0, even.shape[1] // 3)
    assert np.abs(even[:, left] - skewed[:, left]).max() > 0.1  # the distribution panel differs


def test_classification_report_draws_each_class_resolution_over_the_iterations(tmp_path):
    import matplotlib.image

    from cryorefine.report import write_classification_report

    def draw(name, per_class):
        rng = np.random.default_rng(1)
        write_classification_report(tmp_path / name, iteration=3, class_distributions=[[0.5, 0.5]] * 3,
                                    ssnr=np.vstack([np.geomspace(100, 0.01, 17)] * 2), ori_size_px=32,
                                    pixel_size_angstrom=2.0, resolution_angstrom=8.0,
                                    rot_deg=rng.uniform(-180, 180, 100), tilt_deg=rng.uniform(0, 180, 100),
                                    timings_seconds={"expectation": 1.0}, class_changes=[0.5, 0.2, 0.1],
                                    class_resolutions_angstrom=per_class)
        return matplotlib.image.imread(tmp_path / name)

    together = draw("together.png", [[20.0, 20.0], [15.0, 15.0], [12.0, 12.0]])
    apart = draw("apart.png", [[20.0, 20.0], [15.0, 30.0], [12.0, 40.0]])
    width = together.shape[1]
    second = slice(int(0.25 * width), int(0.45 * width))
    assert np.abs(together[:, second] - apart[:, second]).max() > 0.1  # the resolution panel differs


def test_map_views_are_the_central_slices_and_sums_along_each_axis():
    """A map of one voxel at (z, y, x) = (8, 3, 5) and one at (2, 11, 13), 16 px (centre 8): the slice normal to z is
    the z = 8 plane (the first voxel at row y 3, column x 5), the sum along z has both, the slices normal to y and x
    (y = 8, x = 8) have neither."""
    from cryorefine.report import MAP_VIEWS, map_views

    volume = np.zeros((16, 16, 16))
    volume[8, 3, 5], volume[2, 11, 13] = 1.0, 2.0
    views = map_views(volume)
    assert list(views) == list(MAP_VIEWS)
    expected = {name: np.zeros((16, 16)) for name in MAP_VIEWS}
    expected["slice z"][3, 5] = 1.0
    expected["projection z"][3, 5], expected["projection z"][11, 13] = 1.0, 2.0
    expected["projection y"][8, 5], expected["projection y"][2, 13] = 1.0, 2.0  # (z, x)
    expected["projection x"][8, 3], expected["projection x"][2, 11] = 1.0, 2.0  # (z, y)
    for name in MAP_VIEWS:
        np.testing.assert_array_equal(views[name], expected[name], err_msg=name)


def test_the_map_gallery_draws_each_view_pixel_for_pixel(tmp_path):
    """Two classes of 20 px (each view magnified 5 times to 100 px): every view's pixels in the PNG are its values
    scaled from black (its minimum) to white (its maximum), y up, to the 8 bits of the colour map (≤ 2/255)."""
    import matplotlib.image

    from cryorefine.report import MAP_VIEWS, gallery_geometry, map_views, write_map_gallery

    rng = np.random.default_rng(3)
    z = np.arange(20)[:, None, None]
    maps = [rng.normal(size=(20, 20, 20)) + 0.3 * z, rng.normal(size=(20, 20, 20)).cumsum(axis=2)]
    write_map_gallery(tmp_path / "run_it010_report.png", maps, [0.75, 0.25], iteration=10, resolution_angstrom=30.0)
    image = matplotlib.image.imread(tmp_path / "run_it010_report.png")
    geometry = gallery_geometry(2, 20)
    assert geometry.magnification == 5 and image.shape[:2] == (geometry.height_px, geometry.width_px)
    for k, volume in enumerate(maps):
        for column, name in enumerate(MAP_VIEWS):
            x, y = geometry.view_origin(k, column)
            drawn = image[y:y + geometry.view_px, x:x + geometry.view_px, :3]
            view = map_views(volume)[name]
            grey = np.kron((view - view.min()) / (view.max() - view.min()), np.ones((5, 5)))[::-1]  # y up
            assert np.abs(drawn - grey[:, :, None]).max() <= 2 / 255, (k, name)


def gallery_record(path):
    """The panels a class gallery records in its PNG (report.GALLERY_PANELS_KEY): [(class, share, particles)]."""
    import json

    from PIL import Image

    from cryorefine.report import GALLERY_PANELS_KEY

    with Image.open(path) as image:
        return [(p["class_number"], p["share"], p["n_particles"]) for p in json.loads(image.text[GALLERY_PANELS_KEY])]


def test_the_gallery_orders_the_classes_as_relion_largest_share_first(tmp_path):
    """RELION's display of 2D classes sorted on rlnClassDistribution, largest first; equal shares keep their
    class order. Five classes of shares 0.1, 0.3, 0.1, 0.45, 0.05: classes 4, 2, 1, 3, 5."""
    from cryorefine.report import gallery_panels, write_class_gallery

    shares = [0.1, 0.3, 0.1, 0.45, 0.05]
    panels = gallery_panels(shares, [9, 31, 11, 44, 5])
    assert [p.class_number for p in panels] == [4, 2, 1, 3, 5]
    assert [p.title for p in panels][:2] == ["4: 45.0% · 44", "2: 30.0% · 31"]
    images = np.stack([np.outer(np.arange(8.0), np.ones(8)) * k for k in range(1, 6)])
    write_class_gallery(tmp_path / "g.png", images, shares, iteration=2, resolution_angstrom=20.0,
                        particle_counts=[9, 31, 11, 44, 5])
    assert gallery_record(tmp_path / "g.png") == [(4, 0.45, 44), (2, 0.3, 31), (1, 0.1, 9), (3, 0.1, 11),
                                                  (5, 0.05, 5)]
