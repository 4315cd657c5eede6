"""The numpy E-step engine: the oracle every GPU kernel is checked against.

One batch of particles at a time, vectorised over particles × orientations × translations:

1. coarse pass: diff2 for every (class, orientation, translation) of the coarse grid on images
   windowed to the coarse size, as three matrix products (|X|², CTF²·|P|², Re X·conj(CTF·P));
2. weights: priors + (min diff2 − diff2), exponentiated; the fewest coarse samples holding
   `adaptive_fraction` of the mass are significant (RELION's convertAllSquaredDifferencesToWeights);
3. fine pass: the 8 × 4 children (oversampling 1) of each significant coarse sample, at the
   current size, per particle as one dense (fine orientations × fine translations) table whose
   diff2 is one matrix product; their weights are kept as one block of 32 per significant coarse
   sample (`FineBlocks`: one base index per block, Zhang 2018);
4. weighted sums: best pose, pmax, log-likelihood, noise spectra, norm and scale sums, offset
   and class/direction sums, and the back-projection of w·CTF·X/σ² and w·CTF²/σ² per orientation
   (summed over the unit's particles per fine orientation where that grid fits, else over a group's,
   and back-projected once per orientation).

Memory stays bounded however broad the posterior: coarse samples in chunks of particles, the fine pass in
groups of particles, each particle's table rows a chunk at a time, and its (rows × columns) tables of diff2
and weights computed in place.

Precision is selectable: float64 for the oracle (the GPU parity tests), float32 (the command
line's default) as the GPU engine computes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from cryorefine.core.arrays import add_rows_at
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.sampling import LocalOrientations, offset_log_prior
from cryorefine.estep.common import (
    FineBlocks,
    IterationTables,
    local_orientations,
    significant_mask,
    significant_samples,
    significants_limit,
)
from cryorefine.estep.engine import Batch, BatchResult, IterationSetup, WeightedSums

ITERATION_SLICE_ELEMENTS = 1 << 25  # rows × coefficients of the fine grid's projections and slices kept per unit
COARSE_ELEMENTS_PER_CHUNK = 1 << 22  # coarse samples × particles scored at once (~0.2 GB of float64 temporaries)
FINE_TABLE_ELEMENTS_PER_GROUP = 1 << 24  # rows × coefficients of a group's fine table (the default; ~400 MB at float32)
ROW_CHUNK_ELEMENTS = 1 << 18  # rows × coefficients a particle's fine pass takes at once (4 MB of complex128)


class NumpyEngine:
    """The reference engine for one half set (all classes)."""

    def __init__(self, dtype=np.float64, threads: int = 1, keep_blocks=False):
        self.real = np.dtype(dtype)
        self.threads = max(1, int(threads))  # particles of the fine pass run on this many threads
        self._pool = None
        self.complex = np.result_type(self.real, np.complex64)
        self.setup_ = None
        self.tables = None  # IterationTables of the iteration set up
        # with keep_blocks: every particle's FineBlocks of the last batch (tests, diagnostics), as the GPU engine's; a
        # particle of a broad posterior has many (100,000 significant samples of 32 children: 26 MB)
        self.keep_blocks = keep_blocks
        self.last_blocks = []
        self.fine_table_elements = FINE_TABLE_ELEMENTS_PER_GROUP  # bounds the fine pass's memory
        self.coarse_elements = COARSE_ELEMENTS_PER_CHUNK  # bounds the coarse pass's memory
        self.iteration_slice_elements = ITERATION_SLICE_ELEMENTS  # bounds the fine grid kept per unit (_fine_grid)
        self._grid_slices = None
        self.array_module = np  # batches are prepared on the host
        self.stage_seconds = {"coarse": 0.0, "fine": 0.0, "sums": 0.0}  # wall time per E-step stage
        self.stage_flops = {}  # not counted on the host

    # ------------------------------------------------------------------ iteration set-up
    def setup(self, setup: IterationSetup) -> None:
        s = setup
        if s.projectors is None:
            s = replace(s, projectors=[Projector(m, s.padding_factor, s.current_size_px // 2) for m in s.maps])
        self.setup_ = s
        t = self.tables = IterationTables.create(s)
        self.n_classes = t.n_classes
        self.fine, self.coarse = t.fine, t.coarse
        self.minv_fine, self.minv_store, self.minv_coarse = t.minv_fine, t.minv_store, t.minv_coarse
        self.logsigma2 = t.logsigma2
        self.translations, self.fine_translations = t.translations, t.fine_translations
        self.n_orient, self.n_trans, self.n_psi = t.n_orientations, t.n_translations, t.n_psi
        self.children_per_block = t.children_per_block
        self.phase_t = self.fine.phase(self.fine_translations.reshape(-1, 2), s.ori_size_px, self.complex)  # (T·nft, K)
        self.scale = t.scale
        self.avg_norm = s.avg_norm_correction
        if s.local_searches:
            self.coarse_projections = None  # computed per batch for the orientations in range
        else:
            matrices = t.orientation_matrices()
            self.coarse_projections = [self._project(p, matrices, self.coarse) for p in s.projectors]
        r_max = s.current_size_px // 2
        self._grid_slices = None  # the fine grid's slices, summed over the unit's batches (made on first use)
        self.backprojectors = [BackProjector(s.ori_size_px, s.padding_factor, r_max, dtype=self.real, ndim=s.ref_dim)
                               for _ in range(self.n_classes)]
        self.sums_ = WeightedSums.zeros(None, self.n_classes, t.n_optics, t.n_shells, s.sampling.n_directions,
                                        data=[b.data for b in self.backprojectors],
                                        weight=[b.weight for b in self.backprojectors],
                                        n_scale_groups=s.n_scale_groups)

    def _project(self, projector, matrices, coefficients):
        out = []
        for start in range(0, matrices.shape[0], 1024):
            slices = projector.project(matrices[start:start + 1024], coefficients.size_px)
            out.append(coefficients.gather(slices).astype(self.complex))
        return np.concatenate(out) if out else np.zeros((0, coefficients.positions.size), self.complex)

    # ------------------------------------------------------------------ one batch
    def run(self, batch: Batch, local: LocalOrientations | None = None) -> BatchResult:
        """The E-step of one batch (`estep.engine.Engine.run`); `local`: its local-search neighbourhoods when the
        caller computed them ahead, else they are computed here."""
        optics = np.asarray(batch.optics_index)
        groups = np.asarray(batch.scale_group_index)
        ctf_plain = self.fine.gather(np.asarray(batch.ctf)).astype(self.real)
        pre = {
            "x": self.fine.gather(np.asarray(batch.images_ft)).astype(self.complex),
            "x_nomask": self.fine.gather(np.asarray(batch.images_ft_unmasked)).astype(self.complex),
            "ctf": ctf_plain if self.scale is None else ctf_plain * self.scale[groups][:, None].astype(self.real),
            "optics": optics,
            "group": groups,
            "residual": np.asarray(batch.residual_origin_px, dtype=np.float64),
            "old": np.asarray(batch.old_origin_px, dtype=np.float64),
            "prior": np.asarray(batch.origin_prior_px, dtype=np.float64),  # the offsets' prior centre
            "norm": np.asarray(batch.norm_correction, dtype=np.float64),
            "power_beyond": np.asarray(batch.power_beyond_current, dtype=np.float64),
        }
        tic = time.perf_counter()
        if local is None:
            local = local_orientations(self.setup_, batch.prior_rot_deg, batch.prior_tilt_deg, batch.prior_psi_deg)
        b_idx, flat, olp, n_significant = self._coarse_pass(pre, local)
        self.stage_seconds["coarse"] += time.perf_counter() - tic
        # the fine pass in groups of particles, so that memory stays bounded however broad the weights
        parts, blocks = [], []
        for rows in self._fine_groups(b_idx, flat, b_count=len(optics)):
            sub = {name: value[rows] for name, value in pre.items()}
            entries = slice(*np.searchsorted(b_idx, [rows[0], rows[-1] + 1]))
            parts.append(self._fine_pass(sub, b_idx[entries] - rows[0], flat[entries], olp[entries]))
            blocks.extend(self.last_blocks)
        self.last_blocks = blocks
        merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        self.sums_.log_likelihood += float(merged["log_likelihood"].sum())
        self.sums_.sum_pmax += float(merged["pmax"].sum())
        self.sums_.n_particles += batch.indices.size
        return BatchResult(n_significant=n_significant, **merged)

    def _fine_groups(self, b_idx, flat, b_count):
        """Consecutive particles whose fine table (the union of their significant (class, orientation)
        pairs, n_fine_orientations rows each) holds at most `fine_table_elements` rows × coefficients;
        a group holds one particle at least. (b_idx, flat): the significant coarse samples, by particle."""
        n_pairs = int(flat.max()) // self.n_trans + 1 if flat.size else 1
        pair_b, pair_ko = np.divmod(np.unique(b_idx * n_pairs + flat // self.n_trans), n_pairs)
        row_elements = self.tables.n_fine_orientations * self.fine.positions.size
        groups, start = [], 0
        while start < b_count:
            rest = pair_b >= start
            ko, first = np.unique(pair_ko[rest], return_index=True)  # pairs sorted by particle: first user
            first_user = pair_b[rest][first] - start
            union = np.cumsum(np.bincount(first_user, minlength=b_count - start))
            size = max(1, int(np.searchsorted(union * row_elements, self.fine_table_elements, side="right")))
            groups.append(np.arange(start, min(start + size, b_count)))
            start += size
        return groups

    def _coarse_pass(self, pre, local):
        """Coarse diff2 and weights; returns the significant samples (particle, flat index (k·R + o)·T + t,
        by particle then index), their orientations' log priors, and their count per particle (B,).

        A global search runs in chunks of particles of at most `coarse_elements` samples (class ×
        orientation × translation × particle), on `threads` threads: memory stays bounded however large
        the grid. A local search (`local`, core.sampling.LocalOrientations) scores each particle on its
        own orientations.
        """
        s = self.setup_
        b_count = pre["x"].shape[0]
        coarse_sel = self._fine_to_coarse_selection()
        # the orientations compared in this batch: all, or the union of the particles' own
        orient_sel = np.arange(self.n_orient) if local is None else np.unique(local.orientation)
        proj = [self.coarse_projections[k] if self.coarse_projections is not None
                else self._project(projector, self.tables.orientation_matrices(orient_sel), self.coarse)
                for k, projector in enumerate(s.projectors)]
        class_direction_prior = np.asarray(s.log_pdf_class, dtype=np.float64)[:, None] + np.zeros((1, orient_sel.size))
        if s.log_pdf_direction is not None:
            class_direction_prior = class_direction_prior + np.asarray(s.log_pdf_direction)[:, orient_sel // self.n_psi]
        per_particle = self.n_classes * orient_sel.size * self.n_trans
        chunk = max(1, self.coarse_elements // max(1, per_particle))

        def coarse_chunk(start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            rows = slice(start, min(start + chunk, b_count))
            x_c, ctf_c = pre["x"][rows][:, coarse_sel], pre["ctf"][rows][:, coarse_sel]
            minv_c = self.minv_coarse[pre["optics"][rows]]
            shifts_c = pre["residual"][rows][:, None, :] + self.translations[None, :, :]  # (b, T, 2)
            x_shift_c = x_c[:, None, :] * self.coarse.phase(shifts_c, s.ori_size_px, self.complex)
            diff2 = np.stack([self._diff2_dense(x_c, x_shift_c, ctf_c, minv_c, p) for p in proj], axis=1)
            offset_prior = offset_log_prior(self.translations, pre["old"][rows], s.sigma_offset_px, pre["prior"][rows],
                                            translation_scale=s.offset_prior_translation_scale)
            log_prior = class_direction_prior[None, :, :, None] + offset_prior[:, None, None, :]
            n = x_c.shape[0]
            mask, n_sig = self._significant(self._weights(diff2.reshape(n, -1), log_prior.reshape(n, -1)))
            b_local, flat = np.nonzero(mask)
            return b_local + start, flat, np.zeros(flat.size), n_sig

        def coarse_particle(b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            """A local search: the particle's own orientations only, not its batch-mates'."""
            segment = slice(int(local.offsets[b]), int(local.offsets[b + 1]))
            own, own_prior = local.orientation[segment], local.log_prior[segment]
            cols = np.searchsorted(orient_sel, own)
            x_c, ctf_c = pre["x"][b:b + 1, coarse_sel], pre["ctf"][b:b + 1, coarse_sel]
            minv_c = self.minv_coarse[pre["optics"][b:b + 1]]
            shifts_c = pre["residual"][b][None, :] + self.translations  # (T, 2)
            x_shift_c = x_c[:, None, :] * self.coarse.phase(shifts_c, s.ori_size_px, self.complex)[None]
            diff2 = np.stack([self._diff2_dense(x_c, x_shift_c, ctf_c, minv_c, p[cols]) for p in proj], axis=1)
            # centred on the particle's prior, as in a global search (RELION's), not on its previous offset
            offset_prior = offset_log_prior(self.translations, pre["old"][b:b + 1], s.sigma_offset_px,
                                            pre["prior"][b:b + 1], translation_scale=s.offset_prior_translation_scale)
            log_prior = (class_direction_prior[None, :, cols, None] + own_prior[None, None, :, None]
                         + offset_prior[:, None, None, :])
            mask, n_sig = self._significant(self._weights(diff2.reshape(1, -1), log_prior.reshape(1, -1)))
            k, o, t = np.unravel_index(np.flatnonzero(mask), (self.n_classes, cols.size, self.n_trans))
            flat = (k * self.n_orient + own[o]) * self.n_trans + t
            return np.full(flat.size, b), flat, own_prior[o], n_sig

        if local is not None:
            parts = list(self._map(coarse_particle, range(b_count)))
        else:
            parts = list(self._map(coarse_chunk, range(0, b_count, chunk)))
        return tuple(np.concatenate([part[i] for part in parts]) for i in range(4))

    def _fine_pass(self, pre, b_idx, flat, olp):
        """Fine samples of the significant coarse ones, their weights, the sums; per-particle results.

        Per particle, the children of its significant coarse samples are laid out as one dense table:
        rows the fine orientations of its significant (class, orientation) pairs, columns the fine
        translations of its significant translations. diff2 over the table is one matrix product (as
        in the coarse pass); cells outside a significant (orientation, translation) pair are left out.
        The sums are matrix products of the same table: Σ_t w·X_t per row that kept weight, of the
        masked image (noise and scale sums) and of the unmasked one (back-projection). Particles run
        on `threads` threads; their sums are added in particle order.
        """
        s = self.setup_
        b_count = pre["x"].shape[0]
        tic = time.perf_counter()
        ko_flat, t_flat = np.divmod(flat, self.n_trans)  # ko = class · R + orientation
        table = self._fine_table(ko_flat)
        phase_res = self.fine.phase(pre["residual"], s.ori_size_px, self.complex)
        pre = dict(pre, x_res=pre["x"] * phase_res, x_nomask_res=pre["x_nomask"] * phase_res)
        # the particles' slices go straight into the fine grid's where it is kept, else into the group's own
        if table.keys is None:
            shape = (table.n_rows, self.fine.positions.size)
            slices = {"data": np.zeros(shape, self.complex), "weight": np.zeros(shape, self.real)}
        else:
            slices = self._fine_grid()
        ko_of_table = np.searchsorted(table.ko, ko_flat)
        starts = np.searchsorted(b_idx, np.arange(b_count + 1))
        self.stage_seconds["fine"] += time.perf_counter() - tic

        def particle(b: int) -> tuple:
            return self._fine_particle(b, pre, table, ko_of_table[starts[b]:starts[b + 1]],
                                       t_flat[starts[b]:starts[b + 1]], olp[starts[b]:starts[b + 1]])

        tic = time.perf_counter()
        out, seconds = [], np.zeros(2)
        for result, contribution, particle_seconds in self._map(particle, range(b_count)):
            # in particle order: the same sums on any thread count
            self._add_particle_sums(contribution, slices, table.keys)
            out.append(result)
            seconds += particle_seconds
        # the wall time of the particles' passes, shared between the two stages as their thread time is
        wall = time.perf_counter() - tic
        self.stage_seconds["fine"] += wall * seconds[0] / max(seconds.sum(), 1e-12)
        self.stage_seconds["sums"] += wall * seconds[1] / max(seconds.sum(), 1e-12)
        self.last_blocks = [block for block in (o.pop("blocks") for o in out) if block is not None]
        tic = time.perf_counter()
        if table.keys is None:  # else the grid's slices are back-projected once, when the sums are asked for
            self._backproject(table, slices)
        # power beyond the current size counts as noise (RELION extends the spectra with it)
        sums = self.sums_
        n_shells = sums.sigma2_noise.shape[1]
        beyond = pre["power_beyond"][:, :n_shells]
        add_rows_at(sums.sigma2_noise, pre["optics"], beyond)
        sums.sumw_group += np.bincount(pre["optics"], minlength=sums.sumw_group.size)
        wdiff_total = np.array([o.pop("wdiff") for o in out]) + beyond.sum(axis=1)
        new_norm = pre["norm"] / self.avg_norm * np.sqrt(2.0 * wdiff_total)
        sums.norm_correction += float(new_norm.sum())
        self.stage_seconds["sums"] += time.perf_counter() - tic
        merged = {name: np.array([o[name] for o in out]) for name in out[0]}
        return dict(merged, norm_correction=new_norm)

    def sums(self) -> WeightedSums:
        self._backproject_grid()
        return self.sums_

    def _fine_grid(self):
        """Per fine orientation of the whole grid (class, orientation, child; local searches leave most
        of it unused): the projections made so far and the slices summed over the unit's batches; None
        when it would not fit in `iteration_slice_elements`. Made on first use, gone with `sums()`."""
        n_rows = self.n_classes * self.n_orient * self.tables.n_fine_orientations
        if n_rows * self.fine.positions.size > self.iteration_slice_elements:
            return None
        if self._grid_slices is None:
            shape = (n_rows, self.fine.positions.size)
            self._grid_slices = {"proj": np.zeros(shape, self.complex), "projected": np.zeros(n_rows, bool),
                                 "data": np.zeros(shape, self.complex), "weight": np.zeros(shape, self.real),
                                 "touched": np.zeros(n_rows, bool)}
        return self._grid_slices

    def _backproject_grid(self):
        grid, self._grid_slices = self._grid_slices, None
        if grid is None or not grid["touched"].any():
            return
        tic = time.perf_counter()
        n_fo = self.tables.n_fine_orientations
        keys = np.flatnonzero(grid["touched"])
        k, o, jo = np.unravel_index(keys, (self.n_classes, self.n_orient, n_fo))
        unique_o, inverse = np.unique(o, return_inverse=True)
        mats = self.setup_.sampling.fine_orientations(unique_o)[3][inverse, jo]
        for c in range(self.n_classes):
            rows = np.flatnonzero(k == c)
            for start in range(0, rows.size, 512):
                r = rows[start:start + 512]
                self.backprojectors[c].backproject(self.fine.scatter(grid["data"][keys[r]]),
                                                   self.fine.scatter(grid["weight"][keys[r]]), mats[r])
        self.stage_seconds["sums"] += time.perf_counter() - tic

    def _map(self, function, items):
        """function over items, in order; on `threads` threads when there are several, with at most one item more
        than threads under way or done and not yet taken (each holds a particle's slices)."""
        if self.threads == 1:
            yield from map(function, items)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cryorefine-fine")
        pending = deque()
        for item in items:
            if len(pending) > self.threads:
                yield pending.popleft().result()
            pending.append(self._pool.submit(function, item))
        while pending:
            yield pending.popleft().result()

    # ------------------------------------------------------------------ pieces
    def _fine_to_coarse_selection(self):
        """Positions of the coarse coefficients among the fine ones (IterationTables.coarse_selection)."""
        return self.tables.coarse_selection

    def _diff2_dense(self, x, x_shift, ctf, minv, proj):
        """diff2 (B, R, T) of images (B, Kc) at translations (B, T, Kc) against projections (R, Kc)."""
        s = self.setup_
        p2 = (proj.real ** 2 + proj.imag ** 2).astype(self.real)  # (R, Kc)
        if s.do_cc:
            cross = _real_cross(x_shift * ctf[:, None, :], proj)  # (B, T, R)
            norm_p = np.sqrt(np.maximum((ctf ** 2) @ p2.T, 1e-300))  # (B, R)
            norm_x = np.sqrt(np.maximum(np.sum(np.abs(x) ** 2, axis=1), 1e-300))  # (B,)
            return (-cross / (norm_p[:, None, :] * norm_x[:, None, None])).transpose(0, 2, 1)
        a = 0.5 * np.sum(minv * (x.real ** 2 + x.imag ** 2), axis=1)  # (B,)
        term2 = (0.5 * minv * ctf ** 2).astype(self.real) @ p2.T  # (B, R)
        cross = _real_cross(x_shift * (minv * ctf)[:, None, :].astype(self.real), proj)  # (B, T, R)
        return (a[:, None, None] + term2[:, :, None] - cross.transpose(0, 2, 1)).astype(np.float64)

    def _weights(self, diff2, log_prior):
        """Unnormalised weights (B, n): exp(prior + min diff2 − diff2), the best sample alone for CC."""
        if self.setup_.do_cc:
            score = np.where(np.isfinite(log_prior), diff2, np.inf)
            w = np.zeros_like(diff2)
            w[np.arange(diff2.shape[0]), np.argmin(score, axis=1)] = 1.0
            return w
        log_w = log_prior - diff2
        log_w = log_w - np.max(log_w, axis=1, keepdims=True)
        return np.exp(log_w)

    def _significant(self, weights):
        """Mask of the fewest samples holding adaptive_fraction of each row's mass, and their count
        (`common.significant_samples`: the rows' candidates sorted, not whole rows)."""
        s = self.setup_
        return significant_samples(weights, s.adaptive_fraction, significants_limit(s), np)

    def _fine_table(self, ko):
        """The fine orientations of the distinct significant (class, orientation) pairs ko = k·R + o of a
        group of particles, their projections at the current size and the priors that depend on them alone."""
        s = self.setup_
        n_fo = self.tables.n_fine_orientations
        ko = np.unique(ko)
        k_of, o_of = np.divmod(ko, self.n_orient)
        rot, tilt, psi, mats = (a.reshape((-1,) + a.shape[2:]) for a in s.sampling.fine_orientations(o_of))
        k_rows = np.repeat(k_of, n_fo)
        grid = self._fine_grid()
        if grid is None:  # the grid does not fit: the group's own projections
            source = np.empty((k_rows.size, self.fine.positions.size), self.complex)
            missing, keys = np.arange(k_rows.size), None
        else:  # the projections of the fine grid, each made once per unit
            source = grid["proj"]
            keys = (k_rows * self.n_orient + np.repeat(o_of, n_fo)) * n_fo + np.tile(np.arange(n_fo), ko.size)
            missing = np.flatnonzero(~grid["projected"][keys])
        for k, projector in enumerate(s.projectors):
            rows = missing[k_rows[missing] == k]
            if rows.size:
                source[rows if keys is None else keys[rows]] = self._project(projector, mats[rows], self.fine)
        if keys is not None:
            grid["projected"][keys[missing]] = True
        prior = np.asarray(s.log_pdf_class, dtype=np.float64)[k_of]
        if s.log_pdf_direction is not None:
            prior = prior + np.asarray(s.log_pdf_direction)[k_of, o_of // self.n_psi]
        return _FineTable(ko=ko, k=k_of, o=o_of, rot=rot, tilt=tilt, psi=psi, mats=mats, source=source, keys=keys,
                          prior=prior)

    def _fine_particle(self, b, pre, table, ko_pos_all, t_all, olp):
        """One particle's fine pass over its dense table: its results, its share of the sums (to add with
        `_add_particle_sums`) and the seconds of its two stages (fine, sums). Safe to run on threads."""
        s = self.setup_
        tic = time.perf_counter()
        n_fo, n_ft = self.tables.n_fine_orientations, self.tables.n_fine_translations
        u_ko, ko_pos = np.unique(ko_pos_all, return_inverse=True)  # rows of the table (positions in `table`)
        u_t, t_pos = np.unique(t_all, return_inverse=True)  # coarse translations
        n_ko, n_t = u_ko.size, u_t.size
        rows = (u_ko[:, None] * n_fo + np.arange(n_fo)).reshape(-1)
        optics = pre["optics"][b]
        ctf = pre["ctf"][b]
        shifts = self.fine_translations[u_t].reshape(-1, 2)  # (T, 2) fine translations (px)
        phases = self.phase_t.reshape(self.n_trans, n_ft, -1)[u_t].reshape(n_t * n_ft, -1)
        shifted = pre["x_res"][b] * phases  # (T, K)
        x2 = pre["x"][b].real ** 2 + pre["x"][b].imag ** 2
        # diff2 (R, T) from Σ_c weight·|P|² and Re Σ_c image_t·conj(P) per row, the rows a chunk at a time
        if s.do_cc:
            image, power_weight = shifted * ctf, ctf ** 2
        else:
            minv = self.minv_fine[optics]
            image, power_weight = shifted * (minv * ctf).astype(self.real), (minv * ctf ** 2).astype(self.real)
        cross = np.empty((rows.size, image.shape[0]))
        power = np.empty(rows.size)
        for chunk in self._row_chunks(rows.size):
            proj, proj2 = table.projections(rows[chunk])
            cross[chunk] = _real_cross(image, proj).T
            power[chunk] = proj2 @ power_weight
        del image
        # diff2 in the buffer of the cross terms: a particle's tables of (R, T) cells are its largest arrays
        diff2 = cross
        if s.do_cc:
            norm_p = np.sqrt(np.maximum(power, 1e-300))
            norm_x = np.sqrt(max(float(x2.sum()), 1e-300))
            np.negative(diff2, out=diff2)
            diff2 /= norm_p[:, None] * norm_x
        else:
            a = 0.5 * float(np.sum(minv * x2))
            np.subtract(a + 0.5 * power[:, None], diff2, out=diff2)
        in_block = np.zeros((n_ko, n_t), bool)
        in_block[ko_pos, t_pos] = True
        # |offset − prior centre|² of the fine translations (the σ_offset sums), and of their coarse parents: a child
        # has its parent's offset prior (RELION computes pdf_offset at the coarse sampling only)
        centre = pre["prior"][b]
        offset_d2 = np.sum((pre["old"][b] + shifts - centre) ** 2, axis=1)  # (T,)
        parent_d2 = np.sum((pre["old"][b] + s.offset_prior_translation_scale * self.translations[u_t] - centre) ** 2,
                           axis=1)  # (n_t,)
        orientation_prior = np.zeros(n_ko)
        orientation_prior[ko_pos] = olp  # the prior of each significant sample's orientation
        row_prior = np.repeat(table.prior[u_ko] + orientation_prior, n_fo)
        col_prior = np.repeat(-parent_d2 / (2.0 * max(s.sigma_offset_px, 1e-6) ** 2), n_ft)
        prior = row_prior[:, None] + col_prior[None, :]
        considered = np.repeat(np.repeat(in_block, n_fo, axis=0), n_ft, axis=1) & np.isfinite(prior)
        min_diff2 = float(np.min(diff2, where=considered, initial=np.inf))
        # RELION's order of samples: block by block (class, orientation, translation), children inside
        canonical = (n_ko, n_t, n_fo, n_ft)

        def canonical_index(values: np.ndarray,
                            pick: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            flat = pick(values.reshape(n_ko, n_fo, n_t, n_ft).transpose(0, 2, 1, 3))
            i, j, jo, jt = np.unravel_index(flat, canonical)
            return i * n_fo + jo, j * n_ft + jt

        # the weights, in place: prior's buffer holds log w, then w, then the kept w / Σw
        if s.do_cc:
            diff2[~considered] = np.inf
            best = canonical_index(diff2, np.argmin)
            w = prior
            w[...] = 0.0
            w[best] = 1.0
            sum_w, top = 1.0, 0.0
        else:
            diff2 -= min_diff2
            log_w = np.subtract(prior, diff2, out=prior)  # prior − (diff2 − min diff2)
            log_w[~considered] = -np.inf
            top = float(log_w.max())
            log_w -= top
            w = np.exp(log_w, out=log_w)
            sum_w = float(w.sum())
        del diff2, cross, considered
        # the fewest fine samples holding adaptive_fraction of the mass
        positive = w[w > 0]
        positive[::-1].sort()  # descending
        cum = np.cumsum(positive)
        cut = int(np.searchsorted(cum, s.adaptive_fraction * sum_w, side="left"))
        threshold = positive[cut] if cut < positive.size else 0.0
        del positive, cum
        w_norm = w
        w_norm[~significant_mask(w, threshold)] = 0.0
        w_norm /= sum_w
        best_row, best_col = canonical_index(w_norm, np.argmax)
        blocks = None
        if self.keep_blocks:
            ko_index = u_ko[ko_pos]
            coarse_index = (table.k[ko_index] * self.n_orient + table.o[ko_index]) * self.n_trans + u_t[t_pos]
            blocks = FineBlocks(coarse_index, w_norm.reshape(n_ko, n_fo, n_t, n_ft).transpose(0, 2, 1, 3)[
                ko_pos, t_pos].reshape(ko_pos.size, n_fo * n_ft))
        if s.do_cc:
            log_likelihood = -min_diff2
        else:
            log_likelihood = np.log(sum_w) + top - min_diff2 - self.logsigma2[optics]
        t_fine = time.perf_counter()
        contribution = self._particle_sums(b, pre, table, rows, u_ko, u_t, shifted, x2,
                                           w_norm.astype(self.real, copy=False), offset_d2)
        seconds = (t_fine - tic, time.perf_counter() - t_fine)
        best_table_row = rows[best_row]
        origin = pre["old"][b] + shifts[best_col]
        return {"rot_deg": table.rot[best_table_row], "tilt_deg": table.tilt[best_table_row],
                "psi_deg": table.psi[best_table_row], "origin_x_px": origin[0], "origin_y_px": origin[1],
                "class_index": table.k[u_ko[best_row // n_fo]], "pmax": w_norm[best_row, best_col],
                "log_likelihood": log_likelihood, "wdiff": contribution["wdiff"],
                "blocks": blocks}, contribution, seconds

    def _particle_sums(self, b, pre, table, rows, u_ko, u_t, shifted, x2, w, offset_d2):
        """One particle's noise, scale, offset, class and direction sums, its slices to back-project (added by
        `_add_particle_sums`) and its Σ w·|X − CTF·P|² (for the norm correction). The rows that kept weight are
        taken a chunk at a time."""
        s = self.setup_
        sums = self.sums_
        out = {"optics": pre["optics"][b]}
        n_fo = self.tables.n_fine_orientations
        optics = pre["optics"][b]
        ctf = pre["ctf"][b]
        w_row, w_col = w.sum(axis=1), w.sum(axis=0)
        total = float(w_row.sum())
        used = np.flatnonzero(w_row > 0)  # rows with a kept sample: few, once the weights are sharp
        k_used = np.repeat(table.k[u_ko], n_fo)[used]
        # Σ_t w·X_t per used row, of the masked image (noise, scale) and of the unmasked one (back-projection)
        phases = self.phase_t.reshape(self.n_trans, self.tables.n_fine_translations, -1)[u_t].reshape(w.shape[1], -1)
        images = np.concatenate([shifted, pre["x_nomask_res"][b] * phases], axis=1)
        n_coef = shifted.shape[1]
        store = (self.minv_store[optics] * ctf).astype(self.real)
        # per class: Re Σ_r (Σ_t w X_t)·conj(P_r) and Σ_r w_r|P_r|², per coefficient
        classes = np.unique(k_used)
        cross_k = np.zeros((classes.size, n_coef))
        power_k = np.zeros((classes.size, n_coef))
        data = np.empty((used.size, n_coef), self.complex)
        for chunk in self._row_chunks(used.size):
            r = used[chunk]
            proj, proj2 = table.projections(rows[r])
            per_row = _real_weighted(w[r], images)
            masked = per_row[:, :n_coef]
            cross_rows = masked.real * proj.real + masked.imag * proj.imag  # (rows, K)
            power_rows = w_row[r, None] * proj2
            # the rows run class by class (the table's pairs are sorted by class · R + orientation)
            present, first = np.unique(k_used[chunk], return_index=True)
            at = np.searchsorted(classes, present)
            cross_k[at] += np.add.reduceat(cross_rows, first, axis=0)
            power_k[at] += np.add.reduceat(power_rows, first, axis=0)
            # the back-projection: Σ_t w·X_t (unmasked image) per row, times CTF/σ²
            data[chunk] = per_row[:, n_coef:] * store
        # Σ_{r,t} w |X_t − CTF·P_r|² per coefficient = Σw·|X|² + CTF²·Σ_r w_r|P_r|² − 2·CTF·Re Σ_r (Σ_t w X_t)·conj(P_r)
        cross, proj_power = cross_k.sum(axis=0), power_k.sum(axis=0)
        wd2 = np.maximum(total * x2 + ctf ** 2 * proj_power - 2.0 * ctf * cross, 0.0)  # ≥ 0 but for rounding
        n_shells = sums.sigma2_noise.shape[1]
        out["sigma2_noise"] = np.bincount(np.minimum(self.fine.shell, n_shells - 1), weights=wd2, minlength=n_shells)
        out["scale_xa"], out["scale_aa"] = 0.0, 0.0
        out["group"] = pre["group"][b]
        if self.tables.scale_use is not None:
            scale = self.scale[out["group"]]
            for i, k in enumerate(classes):
                use = self.tables.scale_use[k]
                out["scale_xa"] += np.sum(use * ctf * cross_k[i]) / scale
                out["scale_aa"] += np.sum(use * ctf ** 2 * power_k[i]) / scale ** 2
        # the slices: data as above; weight Σ_t w · CTF²/σ², the row's weight times one spectrum
        out["rows"], out["data"] = rows[used], data
        out["row_weight"], out["weight_spectrum"] = w_row[used], store * ctf
        # offsets (Å²), classes, directions
        out["sigma2_offset_angstrom2"] = float(w_col @ offset_d2) * s.pixel_size_angstrom ** 2
        w_ko = w_row.reshape(-1, n_fo).sum(axis=1)
        k_of, o_of = table.k[u_ko], table.o[u_ko]
        out["pdf_class"] = np.bincount(k_of, weights=w_ko, minlength=self.n_classes)
        n_dir = sums.pdf_direction.shape[1]
        out["pdf_direction"] = np.bincount(k_of * n_dir + o_of // self.n_psi, weights=w_ko,
                                           minlength=sums.pdf_direction.size).reshape(sums.pdf_direction.shape)
        out["wdiff"] = float(wd2.sum())
        return out

    def _add_particle_sums(self, c, slices, keys):
        """Add a particle's sums (`_particle_sums`) to the unit's, and its slices to `slices`: the group's rows, or
        the fine grid's where `keys` (the table's rows in the grid) is given."""
        sums = self.sums_
        sums.sigma2_noise[c["optics"]] += c["sigma2_noise"]
        sums.scale_xa[c["group"]] += c["scale_xa"]
        sums.scale_aa[c["group"]] += c["scale_aa"]
        sums.sigma2_offset_angstrom2 += c["sigma2_offset_angstrom2"]
        sums.pdf_class += c["pdf_class"]
        sums.pdf_direction += c["pdf_direction"]
        rows = c["rows"] if keys is None else keys[c["rows"]]
        for chunk in self._row_chunks(rows.size):
            slices["data"][rows[chunk]] += c["data"][chunk]
            slices["weight"][rows[chunk]] += c["row_weight"][chunk, None] * c["weight_spectrum"]
        if keys is not None and c["weight_spectrum"].any():
            slices["touched"][rows] = True

    def _row_chunks(self, n_rows):
        """Slices of n_rows rows of K coefficients, at most ROW_CHUNK_ELEMENTS elements each (one row at least)."""
        step = max(1, ROW_CHUNK_ELEMENTS // max(self.fine.positions.size, 1))
        return [slice(start, start + step) for start in range(0, n_rows, step)]

    def _backproject(self, table, slices):
        """Back-project the summed slices of every fine orientation that received weight."""
        n_fo = self.tables.n_fine_orientations
        k_rows = np.repeat(table.k, n_fo)
        touched = np.flatnonzero(slices["weight"].any(axis=1))
        for k in range(self.n_classes):
            rows = touched[k_rows[touched] == k]
            for start in range(0, rows.size, 512):
                r = rows[start:start + 512]
                self.backprojectors[k].backproject(self.fine.scatter(slices["data"][r]),
                                                   self.fine.scatter(slices["weight"][r]), table.mats[r])

def _real_cross(a, p):
    """Re(a · conj(p)ᵀ) for a (…, K) and p (R, K) as one real matrix product -> (…, R).

    Re(a·conj(p)) summed over K is the dot product of the interleaved (re, im) pairs: the complex
    arrays are viewed as real ones of twice the length, without a copy when they are contiguous.
    """
    lead = a.shape[:-1]
    a = np.ascontiguousarray(a)
    p = np.ascontiguousarray(p, dtype=a.dtype)
    a2 = a.view(a.real.dtype).reshape(-1, 2 * a.shape[-1])
    p2 = p.view(p.real.dtype).reshape(-1, 2 * p.shape[-1])
    return (a2 @ p2.T).reshape(lead + (p.shape[0],))


def _real_weighted(w, values):
    """w (M, N) real times values (N, K) complex, as one real matrix product over (re, im) pairs."""
    values = np.ascontiguousarray(values)
    pairs = values.view(values.real.dtype).reshape(values.shape[0], -1)
    return np.ascontiguousarray(w.astype(pairs.dtype) @ pairs).view(values.dtype)


@dataclass(frozen=True, eq=False)
class _FineTable:
    """The fine orientations of a group's significant (class, orientation) pairs: n_fine_orientations
    rows per pair, in the order of `ko` (class · R + orientation, ascending)."""

    ko: np.ndarray  # (U,) the pairs
    k: np.ndarray  # (U,) their class
    o: np.ndarray  # (U,) their orientation (index in the whole grid)
    rot: np.ndarray  # (U·n_fo,) fine orientations (deg)
    tilt: np.ndarray
    psi: np.ndarray
    mats: np.ndarray  # (U·n_fo, 3, 3)
    source: np.ndarray  # projections at the current size: the table's rows, or the fine grid's (`keys`)
    keys: np.ndarray | None  # (U·n_fo,) the table's rows in `source` when it is the fine grid's
    prior: np.ndarray  # (U,) log prior of the class and direction

    @property
    def n_rows(self) -> int:
        return self.mats.shape[0]

    def projections(self, rows: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        """The projections of the table's `rows` (K coefficients each) and their |P|², copies of those rows alone."""
        proj = self.source[rows if self.keys is None else self.keys[rows]]
        return proj, proj.real ** 2 + proj.imag ** 2
