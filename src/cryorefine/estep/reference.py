"""The numpy E-step engine: the oracle every GPU kernel is checked against.

One batch of particles at a time, vectorised over particles × orientations × translations:

1. coarse pass: diff2 for every (class, orientation, translation) of the coarse grid on images
   windowed to the coarse size, as three matrix products (|X|², CTF²·|P|², Re X·conj(CTF·P));
2. weights: priors + (min diff2 − diff2), exponentiated; the fewest coarse samples holding
   `adaptive_fraction` of the mass are significant (RELION's convertAllSquaredDifferencesToWeights);
3. fine pass: the 8 × 4 children (oversampling 1) of each significant coarse sample, at the
   current size; their weights are kept as one block of 32 per significant coarse sample
   (`FineBlocks`: one base index per block, Zhang 2018);
4. weighted sums: best pose, pmax, log-likelihood, noise spectra, norm and scale sums, offset
   and class/direction sums, and the back-projection of w·CTF·X/σ² and w·CTF²/σ² per orientation.

Precision is selectable: float64 for the oracle, float32 to mirror the GPU engine.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from cryorefine.core import euler
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.sampling import offset_log_prior
from cryorefine.estep.common import FineBlocks, IterationTables, groups_by_size
from cryorefine.estep.engine import BatchResult, IterationSetup, WeightedSums

_SAMPLES_PER_CHUNK_ELEMENTS = 1 << 22  # sample × coefficient elements handled at once
FINE_SAMPLES_PER_GROUP = 1 << 20  # fine samples per group of particles in the fine pass (the default)


class NumpyEngine:
    """The reference engine for one half set (all classes)."""

    def __init__(self, dtype=np.float64):
        self.real = np.dtype(dtype)
        self.complex = np.result_type(self.real, np.complex64)
        self.setup_ = None
        self.tables = None  # IterationTables of the iteration set up
        self.last_blocks = []  # FineBlocks of the last batch, for tests and diagnostics
        self.fine_samples_per_group = FINE_SAMPLES_PER_GROUP  # bounds the fine pass's memory
        self.array_module = np  # batches are prepared on the host
        self.stage_seconds = {"coarse": 0.0, "fine": 0.0, "sums": 0.0}  # wall time per E-step stage
        self.stage_flops = {}  # not counted on the host

    # ------------------------------------------------------------------ iteration set-up
    def setup(self, setup: IterationSetup):
        s = setup
        if s.projectors is None:
            s = replace(s, projectors=[Projector(m, s.padding_factor, s.current_size_px // 2) for m in s.maps])
        self.setup_ = s
        t = self.tables = IterationTables.create(s)
        self.n_classes = t.n_classes
        self.fine, self.coarse = t.fine, t.coarse
        self.minv_fine, self.minv_store, self.minv_coarse = t.minv_fine, t.minv_store, t.minv_coarse
        self.logsigma2 = t.logsigma2
        self.matrices, self.translations, self.fine_translations = t.matrices, t.translations, t.fine_translations
        self.n_orient, self.n_trans = t.n_orientations, t.n_translations
        self.children_per_block = t.children_per_block
        self.direction_of, self.psi_index_of = t.direction_of, t.psi_index_of
        self.scale = t.scale
        self.avg_norm = s.avg_norm_correction
        if s.local_searches:
            self.coarse_projections = None  # computed per batch for the orientations in range
        else:
            self.coarse_projections = [self._project(p, self.matrices, self.coarse) for p in s.projectors]
        r_max = s.current_size_px // 2
        self.backprojectors = [BackProjector(s.ori_size_px, s.padding_factor, r_max, dtype=self.real)
                               for _ in range(self.n_classes)]
        self.sums_ = WeightedSums.zeros(None, self.n_classes, t.n_optics, t.n_shells, s.sampling.n_directions,
                                        data=[b.data for b in self.backprojectors],
                                        weight=[b.weight for b in self.backprojectors])

    def _project(self, projector, matrices, coefficients):
        out = []
        for start in range(0, matrices.shape[0], 1024):
            slices = projector.project(matrices[start:start + 1024], coefficients.size_px)
            out.append(coefficients.gather(slices).astype(self.complex))
        return np.concatenate(out) if out else np.zeros((0, coefficients.positions.size), self.complex)

    # ------------------------------------------------------------------ one batch
    def run(self, batch):
        optics = np.asarray(batch.optics_index)
        ctf_plain = self.fine.gather(np.asarray(batch.ctf)).astype(self.real)
        pre = {
            "x": self.fine.gather(np.asarray(batch.images_ft)).astype(self.complex),
            "x_nomask": self.fine.gather(np.asarray(batch.images_ft_unmasked)).astype(self.complex),
            "ctf": ctf_plain * self.scale[optics][:, None].astype(self.real),
            "optics": optics,
            "residual": np.asarray(batch.residual_origin_px, dtype=np.float64),
            "old": np.asarray(batch.old_origin_px, dtype=np.float64),
            "norm": np.asarray(batch.norm_correction, dtype=np.float64),
            "power_beyond": np.asarray(batch.power_beyond_current, dtype=np.float64),
        }
        orient_log_prior, orient_sel = self._orientation_priors(batch)
        tic = time.perf_counter()
        significant, n_significant = self._coarse_pass(pre, orient_log_prior, orient_sel)
        self.stage_seconds["coarse"] += time.perf_counter() - tic
        # the fine pass in groups of particles, so that memory stays bounded however broad the weights
        parts, blocks = [], []
        for rows in groups_by_size(n_significant * self.children_per_block, self.fine_samples_per_group):
            sub = {name: value[rows] for name, value in pre.items()}
            parts.append(self._fine_pass(sub, significant[rows], orient_log_prior[rows], orient_sel))
            blocks.extend(self.last_blocks)
        self.last_blocks = blocks
        merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        self.sums_.log_likelihood += float(merged["log_likelihood"].sum())
        self.sums_.sum_pmax += float(merged["pmax"].sum())
        self.sums_.n_particles += batch.indices.size
        return BatchResult(n_significant=n_significant, **merged)

    def _coarse_pass(self, pre, orient_log_prior, orient_sel):
        """Coarse diff2 and weights; returns the significance mask (B, K·R·T) and counts (B,)."""
        s = self.setup_
        b_count = pre["x"].shape[0]
        coarse_sel = self._fine_to_coarse_selection()
        x_c, ctf_c = pre["x"][:, coarse_sel], pre["ctf"][:, coarse_sel]
        minv_c = self.minv_coarse[pre["optics"]]
        shifts_c = pre["residual"][:, None, :] + self.translations[None, :, :]  # (B, T, 2)
        x_shift_c = x_c[:, None, :] * self.coarse.phase(shifts_c, s.ori_size_px, self.complex)
        diff2 = np.empty((b_count, self.n_classes, orient_sel.size, self.n_trans))
        for k, projector in enumerate(s.projectors):
            if self.coarse_projections is not None:
                proj = self.coarse_projections[k][orient_sel]
            else:
                proj = self._project(projector, self.matrices[orient_sel], self.coarse)
            diff2[:, k] = self._diff2_dense(x_c, x_shift_c, ctf_c, minv_c, proj)
        log_prior = (np.asarray(s.log_pdf_class)[None, :, None, None]
                     + orient_log_prior[:, None, :, None])
        if s.log_pdf_direction is not None:
            log_prior = log_prior + np.asarray(s.log_pdf_direction)[None, :, self.direction_of[orient_sel], None]
        offset_prior_centre = pre["old"] if s.local_searches else None
        log_prior = log_prior + offset_log_prior(
            self.translations, pre["old"], s.sigma_offset_px, offset_prior_centre)[:, None, None, :]
        weights = self._weights(diff2.reshape(b_count, -1), log_prior.reshape(b_count, -1))
        return self._significant(weights)

    def _fine_pass(self, pre, significant, orient_log_prior, orient_sel):
        """Fine samples of the significant coarse ones, their weights, the sums; per-particle results."""
        s = self.setup_
        b_count = pre["x"].shape[0]
        optics, old = pre["optics"], pre["old"]
        b_idx, flat = np.nonzero(significant)
        k_idx, o_sel, t_idx = np.unravel_index(flat, (self.n_classes, orient_sel.size, self.n_trans))
        o_idx = orient_sel[o_sel]
        tic = time.perf_counter()
        fine = self._fine_samples(b_idx, k_idx, o_idx, t_idx)
        diff2_fine = self._diff2_samples(fine, pre["x"], pre["ctf"], self.minv_fine[optics], pre["residual"])
        prior_fine = (np.asarray(s.log_pdf_class)[fine["k"]]
                      + orient_log_prior[fine["b"], np.searchsorted(orient_sel, fine["o"])])
        if s.log_pdf_direction is not None:
            prior_fine = prior_fine + np.asarray(s.log_pdf_direction)[fine["k"], self.direction_of[fine["o"]]]
        off = old[fine["b"]] + fine["t_px"]
        centre = old[fine["b"]] if s.local_searches else 0.0
        prior_fine = prior_fine - np.sum((off - centre) ** 2, axis=1) / (2.0 * max(s.sigma_offset_px, 1e-6) ** 2)
        w_fine, min_diff2, sum_w, log_scale = self._sample_weights(diff2_fine, prior_fine, fine["b"], b_count)
        kept = self._significant_samples(w_fine, fine["b"], b_count)
        w_norm = np.where(kept, w_fine / sum_w[fine["b"]], 0.0)
        self.stage_seconds["fine"] += time.perf_counter() - tic
        self._store_blocks(fine, w_norm, b_count)
        best = self._best_sample(w_norm, fine["b"], b_count)
        if s.do_cc:
            log_likelihood = -min_diff2
        else:
            log_likelihood = np.log(sum_w) + log_scale - min_diff2 - self.logsigma2[optics]
        tic = time.perf_counter()
        new_norm = self._weighted_sums(fine, w_norm, kept, pre)
        self.stage_seconds["sums"] += time.perf_counter() - tic
        origin = old + fine["t_px"][best]
        return {"rot_deg": fine["rot"][best], "tilt_deg": fine["tilt"][best], "psi_deg": fine["psi"][best],
                "origin_x_px": origin[:, 0], "origin_y_px": origin[:, 1], "class_index": fine["k"][best],
                "pmax": w_norm[best], "log_likelihood": log_likelihood, "norm_correction": new_norm}

    def sums(self):
        return self.sums_

    # ------------------------------------------------------------------ pieces
    def _fine_to_coarse_selection(self):
        """Positions of the coarse coefficients among the fine ones (IterationTables.coarse_selection)."""
        return self.tables.coarse_selection

    def _orientation_priors(self, batch):
        s = self.setup_
        b_count = batch.indices.size
        if not s.local_searches:
            return np.zeros((b_count, self.n_orient)), np.arange(self.n_orient)
        prior = s.sampling.local_prior(batch.prior_rot_deg, batch.prior_tilt_deg, batch.prior_psi_deg,
                                       s.sigma_rot_deg, s.sigma_psi_deg)
        lp = np.asarray(prior.dir_log_prior)[:, self.direction_of] + np.asarray(prior.psi_log_prior)[:, self.psi_index_of]
        sel = np.flatnonzero(np.isfinite(lp).any(axis=0))
        return lp[:, sel], sel

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
        """Mask of the fewest samples holding adaptive_fraction of each row's mass, and their count."""
        s = self.setup_
        order = np.argsort(-weights, axis=1, kind="stable")
        sorted_w = np.take_along_axis(weights, order, axis=1)
        if s.adaptive_fraction >= 1.0:  # all of the mass: every sample of positive weight (no rounding games)
            n_sig = np.maximum((weights > 0).sum(axis=1), 1)
        else:
            cum = np.cumsum(sorted_w, axis=1)
            n_sig = np.sum(cum < s.adaptive_fraction * cum[:, -1:], axis=1) + 1
        n_sig = np.minimum(n_sig, weights.shape[1])
        if s.max_significants > 0:
            n_sig = np.minimum(n_sig, s.max_significants)
        threshold = sorted_w[np.arange(weights.shape[0]), n_sig - 1]
        mask = (weights >= threshold[:, None]) & (weights > 0)
        return mask, n_sig

    def _fine_samples(self, b_idx, k_idx, o_idx, t_idx):
        """All children of the significant coarse samples, block by block (32 per block at oversampling 1)."""
        s = self.setup_
        unique_o, inverse = np.unique(o_idx, return_inverse=True)
        rot, tilt, psi = (np.asarray(a) for a in s.sampling.fine_orientations_deg(unique_o))  # (U, nfo)
        n_fo = rot.shape[1]
        n_ft = self.fine_translations.shape[1]
        n_blocks = b_idx.size
        jo = np.repeat(np.arange(n_fo), n_ft)  # child orientation of fine sample f
        jt = np.tile(np.arange(n_ft), n_fo)  # child translation of fine sample f
        rows = inverse[:, None] * n_fo + jo[None, :]  # (n_blocks, F) rows of the fine orientation table
        return {
            "b": np.repeat(b_idx, n_fo * n_ft), "k": np.repeat(k_idx, n_fo * n_ft),
            "o": np.repeat(o_idx, n_fo * n_ft), "t": np.repeat(t_idx, n_fo * n_ft),
            "block": np.repeat(np.arange(n_blocks), n_fo * n_ft),
            "row": rows.reshape(-1), "unique_o": unique_o,
            "rot": rot.reshape(-1)[rows.reshape(-1)], "tilt": tilt.reshape(-1)[rows.reshape(-1)],
            "psi": psi.reshape(-1)[rows.reshape(-1)],
            "t_px": self.fine_translations[np.repeat(t_idx, n_fo * n_ft), np.tile(jt, n_blocks)],
            "tf": np.repeat(t_idx, n_fo * n_ft) * n_ft + np.tile(jt, n_blocks),
            "children": n_fo * n_ft, "n_blocks": n_blocks, "k_of_block": k_idx, "o_of_block": o_idx,
            "t_of_block": t_idx, "b_of_block": b_idx,
        }

    def _fine_projections(self, fine):
        """Projections (per class) at the current size for the fine orientation table rows."""
        s = self.setup_
        # one projection per distinct (class, fine orientation row)
        key = fine["k"] * (fine["row"].max() + 1 if fine["row"].size else 1) + fine["row"]
        unique_key, inverse = np.unique(key, return_inverse=True)
        first = np.zeros(unique_key.size, dtype=np.int64)
        first[inverse[::-1]] = np.arange(key.size)[::-1]
        mats = euler.euler_to_matrix(fine["rot"][first], fine["tilt"][first], fine["psi"][first])
        proj = np.empty((unique_key.size, self.fine.positions.size), self.complex)
        for k, projector in enumerate(s.projectors):
            sel = np.flatnonzero(fine["k"][first] == k)
            if sel.size:
                proj[sel] = self._project(projector, mats[sel], self.fine)
        return proj, inverse, mats, fine["k"][first]

    def _diff2_samples(self, fine, x, ctf, minv, residual):
        """diff2 of every fine sample, gathered per sample (the GPU's sparse fine kernel)."""
        s = self.setup_
        proj, inverse, mats, classes = self._fine_projections(fine)
        self._fine_proj = (proj, inverse, mats, classes)
        n = inverse.size
        out = np.empty(n)
        x_res, phase_t = self._shift_tables(x, residual)
        chunk = max(1, _SAMPLES_PER_CHUNK_ELEMENTS // max(1, x.shape[1]))
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            b = fine["b"][sl]
            p = proj[inverse[sl]]
            shifted = x_res[b] * phase_t[fine["tf"][sl]]
            cp = ctf[b] * p
            if s.do_cc:
                cross = np.sum(shifted.real * cp.real + shifted.imag * cp.imag, axis=1)
                norm = np.sqrt(np.maximum(np.sum(np.abs(cp) ** 2, axis=1), 1e-300)
                               * np.maximum(np.sum(np.abs(x[b]) ** 2, axis=1), 1e-300))
                out[sl] = -cross / norm
            else:
                diff = shifted - cp
                out[sl] = 0.5 * np.sum(minv[b] * (diff.real ** 2 + diff.imag ** 2), axis=1)
        return out

    def _shift_tables(self, x, residual):
        """Images moved by their residual origins (B, K) and the phases of all fine translations (T·nft, K).

        A fine sample's shifted image is x_res[b] · phase_t[tf]: shifts add, phases multiply.
        """
        ori = self.setup_.ori_size_px
        x_res = x * self.fine.phase(residual, ori, self.complex)
        phase_t = self.fine.phase(self.fine_translations.reshape(-1, 2), ori, self.complex)
        return x_res, phase_t

    def _sample_weights(self, diff2, log_prior, b, b_count):
        """Fine-sample weights (max 1 per particle), min diff2, Σw and the log scale of Σw per particle."""
        min_diff2 = np.full(b_count, np.inf)
        np.minimum.at(min_diff2, b, np.where(np.isfinite(log_prior), diff2, np.inf))
        if self.setup_.do_cc:
            w = np.zeros_like(diff2)
            score = np.where(np.isfinite(log_prior), diff2, np.inf)
            order = np.lexsort((score, b))
            first = order[np.r_[True, b[order][1:] != b[order][:-1]]]
            w[first] = 1.0
            return w, min_diff2, np.ones(b_count), np.zeros(b_count)
        log_w = log_prior - (diff2 - min_diff2[b])
        top = np.full(b_count, -np.inf)
        np.maximum.at(top, b, log_w)
        w = np.exp(log_w - top[b])
        # Σw per particle is returned in log form: RELION's Σ exp(prior + min − diff2) = exp(top)·Σw
        return w, min_diff2, np.bincount(b, weights=w, minlength=b_count), top

    def _significant_samples(self, w, b, b_count):
        """Per particle, the fewest fine samples holding adaptive_fraction of the mass."""
        frac = self.setup_.adaptive_fraction
        order = np.lexsort((-w, b))
        wb = w[order]
        bb = b[order]
        total = np.bincount(b, weights=w, minlength=b_count)
        cum = np.cumsum(wb)
        start = np.searchsorted(bb, np.arange(b_count))
        before = np.where(start > 0, cum[np.maximum(start - 1, 0)], 0.0)
        cum_in = cum - before[bb]
        first_over = cum_in >= frac * total[bb]
        # threshold per particle: the weight at the first position where the mass is reached
        idx = np.flatnonzero(first_over)
        pos = np.full(b_count, np.iinfo(np.int64).max)
        np.minimum.at(pos, bb[idx], idx)
        threshold = np.where(pos < np.iinfo(np.int64).max, wb[np.minimum(pos, wb.size - 1)], 0.0)
        return (w >= threshold[b]) & (w > 0)

    def _store_blocks(self, fine, w_norm, b_count):
        blocks = []
        weights = w_norm.reshape(fine["n_blocks"], fine["children"]) if fine["n_blocks"] else np.zeros((0, 1))
        coarse_index = ((fine["k_of_block"] * self.n_orient + fine["o_of_block"]) * self.n_trans
                        + fine["t_of_block"])
        for b in range(b_count):
            sel = fine["b_of_block"] == b
            blocks.append(FineBlocks(coarse_index[sel], weights[sel]))
        self.last_blocks = blocks

    def _best_sample(self, w, b, b_count):
        order = np.lexsort((-w, b))
        first = np.searchsorted(b[order], np.arange(b_count))
        return order[first]

    def _weighted_sums(self, fine, w, kept, pre):
        """Noise, norm, scale, offset, class and direction sums; back-projection of kept samples."""
        s = self.setup_
        x, x_nomask, ctf = pre["x"], pre["x_nomask"], pre["ctf"]
        optics, residual, old = pre["optics"], pre["residual"], pre["old"]
        sums = self.sums_
        proj, inverse, mats, classes = self._fine_proj
        sel = np.flatnonzero(kept)
        n_coef = self.fine.positions.size
        n_shells = sums.sigma2_noise.shape[1]
        b_count = x.shape[0]
        wdiff_total = np.zeros(b_count)
        # one slice per fine orientation that a kept sample uses
        used_rows, slot = np.unique(inverse[sel], return_inverse=True)
        data_slices = np.zeros((used_rows.size, n_coef), self.complex)
        weight_slices = np.zeros((used_rows.size, n_coef), self.real)
        x_res, phase_t = self._shift_tables(x, residual)
        x_nomask_res, _ = self._shift_tables(x_nomask, residual)
        chunk = max(1, _SAMPLES_PER_CHUNK_ELEMENTS // max(1, n_coef))
        for start in range(0, sel.size, chunk):
            ss = sel[start:start + chunk]
            b = fine["b"][ss]
            ws = w[ss][:, None]
            phase = phase_t[fine["tf"][ss]]
            cp = ctf[b] * proj[inverse[ss]]
            shifted = x_res[b] * phase
            diff = shifted - cp
            wd2 = ws * (diff.real ** 2 + diff.imag ** 2)
            wdiff_total += np.bincount(b, weights=wd2.sum(axis=1), minlength=b_count)
            idx = (optics[b][:, None] * n_shells + np.minimum(self.fine.shell, n_shells - 1)[None, :])
            sums.sigma2_noise += np.bincount(idx.reshape(-1), weights=wd2.reshape(-1),
                                             minlength=sums.sigma2_noise.size).reshape(sums.sigma2_noise.shape)
            if self.tables.scale_use is not None:
                use = self.tables.scale_use[fine["k"][ss]]
                xa = np.sum(use * ws * (cp.real * shifted.real + cp.imag * shifted.imag), axis=1)
                aa = np.sum(use * ws * (cp.real ** 2 + cp.imag ** 2), axis=1)
                scale = self.scale[optics[b]]
                sums.scale_xa += np.bincount(optics[b], weights=xa / scale, minlength=sums.scale_xa.size)
                sums.scale_aa += np.bincount(optics[b], weights=aa / scale ** 2, minlength=sums.scale_aa.size)
            minv = self.minv_store[optics[b]]
            store = ws * minv * ctf[b]
            contrib = x_nomask_res[b] * phase * store
            # sum the samples of each fine orientation (segments of the sorted rows), then add per row
            rows = slot[start:start + chunk]
            order = np.argsort(rows, kind="stable")
            starts = np.r_[0, np.flatnonzero(np.diff(rows[order])) + 1]
            touched = rows[order][starts]
            data_slices[touched] += np.add.reduceat(contrib[order], starts, axis=0).astype(self.complex)
            weight_slices[touched] += np.add.reduceat((store * ctf[b])[order], starts, axis=0).astype(self.real)
        # the back-projection of every orientation that received weight
        for k in range(self.n_classes):
            rows = np.flatnonzero(classes[used_rows] == k)
            for start in range(0, rows.size, 512):
                r = rows[start:start + 512]
                self.backprojectors[k].backproject(self.fine.scatter(data_slices[r]),
                                                   self.fine.scatter(weight_slices[r]), mats[used_rows[r]])
        # power beyond the current size counts as noise (RELION extends the spectra with it)
        beyond = pre["power_beyond"].copy()
        beyond[:, : s.current_size_px // 2 + 1] = 0.0
        beyond = beyond[:, :n_shells]
        np.add.at(sums.sigma2_noise, optics, beyond)
        wdiff_total += beyond.sum(axis=1)
        sums.sumw_group += np.bincount(optics, minlength=sums.sumw_group.size)
        # offsets (Å²), classes, directions
        off = old[fine["b"][sel]] + fine["t_px"][sel]
        centre = old[fine["b"][sel]] if s.local_searches else 0.0
        d2 = np.sum((off - centre) ** 2, axis=1)
        sums.sigma2_offset_angstrom2 += float(np.sum(w[sel] * d2)) * s.pixel_size_angstrom ** 2
        sums.pdf_class += np.bincount(fine["k"][sel], weights=w[sel], minlength=self.n_classes)
        n_dir = sums.pdf_direction.shape[1]
        sums.pdf_direction += np.bincount(fine["k"][sel] * n_dir + self.direction_of[fine["o"][sel]],
                                          weights=w[sel], minlength=sums.pdf_direction.size).reshape(
            sums.pdf_direction.shape)
        new_norm = pre["norm"] / self.avg_norm * np.sqrt(2.0 * wdiff_total)
        sums.norm_correction += float(new_norm.sum())
        return new_norm


def _real_cross(a, p):
    """Re(a · conj(p)ᵀ) for a (…, K) and p (R, K) as one real matrix product -> (…, R)."""
    lead = a.shape[:-1]
    a2 = np.concatenate([a.real, a.imag], axis=-1).reshape(-1, 2 * a.shape[-1])
    p2 = np.concatenate([p.real, p.imag], axis=-1)
    return (a2 @ p2.T).reshape(lead + (p.shape[0],))
