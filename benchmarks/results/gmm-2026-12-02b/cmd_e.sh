# lease 2 of 2026-12-02 (afternoon): speed_session (this checkout with the Pallas dw default, a profile,
# per-head Muon, the baseline c1b4145 in the same lease, the optimizer alone); eight files at most come back
mkdir -p $OUT/s
OUT=$OUT/s BASE=.device/base BUDGET=545 bash benchmarks/speed_session.sh > $OUT/session.log 2>&1
cd $OUT/s && rm -f step_small.hlo.gz && tar czf ../session.tgz . && cd .. && rm -rf s
