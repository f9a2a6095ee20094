"""The policy's I/O edge: a daemon thread that feeds every job's per-member counters to the straggler
detector and the policy (``aggd.core.policy``), applies their decisions through the service's hot
swap, and keeps the policy's state next to the registry's. It also declares silent members gone
and awaits them again once they keep pace (``aggd.core.departures``)."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from pathlib import Path

from aggd.core.departures import DepartureRules, ScoreWatch, bounds_text, keeps_pace, offenders, silent_members, skipped_round_open
from aggd.core.policy import Decision, JobPolicy, PolicyRules, rules_from_config
from aggd.core.straggler import Detector

log = logging.getLogger("aggd.daemon.policy_runner")

#: Decisions kept per job for ``aggctl workers`` / ``aggctl status``.
KEEP_DECISIONS = 20
#: Next to the registry's state.json: the jobs the policy has switched and their own strategies.
STATE_FILE = "policy.json"


class PolicyRunner:
    """Reads every job's per-member counters each ``policy.interval_ms``, runs the detector and, with
    ``policy.auto_switch``, the policy; applies decisions through ``service.cmd_strategy_set`` (the
    hot swap: the new version starts after the highest round the data planes have seen).

    Holds the service's lock while it reads and switches, so it never races aggctl or a JOIN."""

    def __init__(self, service):
        self.service = service
        self.detectors: dict[int, Detector] = {}
        self.policies: dict[int, JobPolicy] = {}
        self.decisions: dict[int, deque] = {}
        self._who: dict[int, tuple] = {}   # job id -> (name, created_at): ids are reused
        self._scanned: dict[int, float] = {}   # job id -> when its open rounds were last read
        self._offences: dict[int, dict[int, int]] = {}  # job id -> rank -> offences forgiven
        self._scores: dict[int, ScoreWatch] = {}  # robust job id -> its members' score windows
        # Silence counts from here: members wait through a restart of the daemon (or its data plane).
        self._since_ns = time.monotonic_ns()
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # what the policy switched, so a restarted daemon still knows a job's own strategy
        self._path = Path(service.state_path).with_name(STATE_FILE)
        try:
            self._saved = json.loads(self._path.read_text())
        except (OSError, ValueError):
            self._saved = {}

    def _forget(self, jid: int) -> None:
        for d in (self.detectors, self.policies, self.decisions, self._who, self._scanned, self._offences,
                  self._scores):
            d.pop(jid, None)

    def _save(self) -> None:
        data = {str(j): {"own": p.own, "switched": p.switched, "stragglers": list(p.stragglers)}
                for j, p in self.policies.items() if p.switched}
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(data) + "\n")
            tmp.replace(self._path)
        except OSError as exc:
            log.error("cannot write %s: %s", self._path, exc)

    # configuration (re-read every tick: a SIGHUP applies at once)
    def _cfg(self):
        return self.service.config.policy

    def rules(self) -> PolicyRules:
        return rules_from_config(self._cfg())

    def start(self) -> "PolicyRunner":
        self._thread = threading.Thread(target=self._run, name="aggd-policy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(max(0.02, self._cfg().interval_ms / 1000)):
            try:
                self.tick(time.monotonic())
            except Exception:  # never let the watcher kill the daemon; say it once per kind
                self.errors += 1
                log.exception("policy tick failed")

    def tick(self, now: float) -> list[tuple[str, Decision]]:
        """One pass over the jobs; returns the decisions applied (for tests)."""
        svc = self.service
        made = []
        with svc.lock:
            rules = self.rules()
            jobs = {j.id: j for j in svc.registry.list()}
            for jid in list(self._who):  # a job deleted (and its id perhaps reused): forget it
                if jid not in jobs or self._who[jid] != (jobs[jid].name, jobs[jid].created_at):
                    self._forget(jid)
            for jid, j in jobs.items():
                self._who[jid] = (j.name, j.created_at)
            for job in jobs.values():
                det = self.detectors.get(job.id)
                if det is None or det.world != job.world or det.config != rules.detector():
                    det = self.detectors[job.id] = Detector(job.world, rules.detector())
                rows = svc.member_stats(job)
                if rows is None:
                    continue
                gone = ((1 << job.world) - 1) & ~job.awaited     # slow nobody: rounds do not wait for them
                obs = det.update_rows(now, rows, absent=gone)
                self._watch_members(job, rows, det, now)
                pol = self.policies.get(job.id)
                current = str(job.strategy)
                if pol is None:
                    pol = self.policies[job.id] = JobPolicy(rules, own=current)
                    saved = self._saved.get(str(job.id))
                    if saved and saved.get("switched") == current:  # a restart while switched
                        pol.own, pol.switched = saved["own"], current
                        pol.stragglers = tuple(saved.get("stragglers", ()))
                pol.rules = rules
                if obs is None:
                    continue
                pol.sync_with(current)
                # a rack job is sync at every level: not the policy's to switch
                if not self._cfg().auto_switch or job.upstream is not None or not rules.manages(job.name, pol.own):
                    continue
                decision = pol.step(obs, current, now)
                if decision is None:
                    continue
                try:
                    shown = svc.cmd_strategy_set(job.id, decision.strategy)
                except Exception as exc:  # ControlError: the data planes refused; nothing changed
                    pol.failed(decision, str(exc), now)
                    log.error("job %s: policy could not switch to %s: %s", job.name, decision.strategy, exc)
                    continue
                from_round = shown["versions"][-1]["from_round"]
                pol.applied(decision, from_round, now)
                self._save()
                entry = {**decision.to_json(), "from": current, "from_round": from_round,
                         "version": shown["version"], "time": time.time()}
                self.decisions.setdefault(job.id, deque(maxlen=KEEP_DECISIONS)).append(entry)
                log.warning("job %s: policy switched %s -> %s from round %d (round %d seen): %s",
                            job.name, current, decision.strategy, from_round, decision.round, decision.reason)
                made.append((job.name, decision))
        return made

    def departure_rules(self) -> DepartureRules:
        cfg = self._cfg()
        return DepartureRules(cfg.silent_after, cfg.silent_steps, cfg.readmit_rounds)

    def _watch_members(self, job, rows: list[dict], det: Detector, now: float) -> None:
        """Declare gone the members a round has waited for too long; await the gone ones that
        keep pace again. The slots are read only while some member has been quiet that long, at
        most four times per threshold."""
        svc, rules = self.service, self.departure_rules()
        step_s = det.last.period_ms / 1000 if det.last is not None and det.last.period_ms else None
        limit, now_ns = rules.threshold_s(step_s), int(now * 1e9)
        self._quarantine(job, rows)
        self._score_quarantine(job, rows)
        for rank, gone in list(job.gone.items()):
            if job.quarantined(rank):
                continue      # let back in by hand only (aggctl workers readmit)
            # the slots are read only for a member that keeps pace otherwise
            if keeps_pace(rows, rank, gone["round"], job.awaited, rules) and \
                    skipped_round_open(svc.open_rounds(job) or [], rank, gone["round"]) is None:
                svc.readmit(job, rank, f"at the job's newest round again (gone since round {gone['round']})")
        if rules.silent_after_s <= 0:
            return
        quiet = [r for r in rows if job.awaited >> int(r["rank"]) & 1
                 and (r["last_round"] is None or now_ns - r["last_ns"] >= limit * 1e9)]
        if not quiet or now - self._scanned.get(job.id, float("-inf")) < limit / 4:
            return
        self._scanned[job.id] = now
        open_rounds = svc.open_rounds(job)
        if open_rounds is None:
            return
        for s in silent_members(rows, open_rounds, now_ns, job.awaited, rules, step_s, self._since_ns,
                                starting=svc.restart_waits_for(job)):
            try:
                svc.depart(job, s.rank, s.reason())
            except Exception as exc:  # refused (the last awaited member, a data plane that cannot)
                log.error("job %s: rank %d is silent but cannot be declared gone: %s", job.name, s.rank, exc)

    def _quarantine(self, job, rows: list[dict]) -> None:
        """Quarantine the members of a bounded job whose contributions went beyond its bound
        ``quarantine_after`` times since they were last let in (``aggd.core.departures.offenders``)."""
        if (job.max_abs is None and job.max_norm is None) or not job.quarantine_after:
            return
        counted = self._offences.setdefault(job.id, {})
        for r in rows:   # a gone member's count so far is forgiven when it is let back in
            if int(r["rank"]) in job.gone:
                counted[int(r["rank"])] = int(r.get("offences", 0))
        for o in offenders(rows, job.gone, counted, job.quarantine_after, bounds_text(job.max_abs, job.max_norm)):
            try:
                self.service.depart(job, o.rank, o.reason(), quarantine=True)
            except Exception as exc:  # refused (the last awaited member)
                log.error("job %s: rank %d is out of bounds but cannot be quarantined: %s", job.name, o.rank, exc)

    def _score_quarantine(self, job, rows: list[dict]) -> None:
        """Score a robust job's members over this window; quarantine those whose score stayed
        below SUSPECT_SCORE (-0.5) for ``score_after`` windows (``aggd.core.departures.ScoreWatch``)."""
        if not job.combine_rule.robust:
            return
        watch = self._scores.get(job.id)
        if watch is None or (watch.rho, watch.after) != (job.score_rho, job.score_after):
            watch = self._scores[job.id] = ScoreWatch(job.score_rho, job.score_after, job.combine)
        for s in watch.observe(rows, job.gone):
            try:
                self.service.depart(job, s.rank, s.reason(), quarantine=True)
            except Exception as exc:  # refused (the last awaited member)
                log.error("job %s: rank %d scores %.2f but cannot be quarantined: %s", job.name, s.rank,
                          s.score, exc)

    def score_watch(self, job_id: int) -> ScoreWatch | None:
        """A robust job's score windows (for the metrics), None for any other job."""
        return self._scores.get(job_id)

    # views for aggctl
    def view(self, job, rank: int | None = None) -> dict:
        det = self.detectors.get(job.id)
        if rank is not None:
            watch = self._scores.get(job.id)
            score = None if watch is None else watch.last.get(rank)
            if det is None or rank >= det.world or det.last is None:
                return {"lag": None, "lag_ms": None, "slowdown": None, "wait_s": None, "late": None,
                        "straggler": None, "score": score}
            w = det.workers[rank].to_json()
            return {"lag": None if w["lag_ms"] is None else round(w["lag_ms"], 1), "lag_ms": w["lag_ms"],
                    "slowdown": w["slowdown"], "wait_s": w["wait_s"], "late": w["late"],
                    "straggler": w["straggler"], "score": score}
        pol = self.policies.get(job.id)
        decisions = list(self.decisions.get(job.id, ()))
        return {"policy": {
            "auto_switch": bool(self._cfg().auto_switch),
            "managed": bool(pol is not None and self.rules().manages(job.name, pol.own)),
            **(pol.to_json() if pol else {}),
            "stragglers_now": [] if det is None or det.last is None else list(det.last.stragglers),
            "period_ms": None if det is None or det.last is None else round(det.last.period_ms, 3),
            "last_decision": decisions[-1] if decisions else None,
            "decisions": decisions}}
