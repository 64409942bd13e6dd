# GPU A/B for fp8-row-trees.patch (session 30; see README.md here). Run on the device from the repository root
# with the patch applied and the pre-patch fwd_sm90.py saved as ab_base_fwd_sm90.py (an untracked file travels
# with the tree), 3.9 pack carried:
#   git show HEAD:fusedattn/backends/gluon/fwd_sm90.py > ab_base_fwd_sm90.py; git apply bench/pending/fp8-row-trees.patch
#   (device) export PYTHONPATH=$PWD; bash bench/pending/fp8-row-trees-ab.sh
# Everything goes to $OUT/ab.log as it runs (a timed-out call still returns it).
LOG=$OUT/ab.log
F=fusedattn/backends/gluon/fwd_sm90.py
cp $F /tmp/new.py
# the bf16 path with the trees too (the patch keeps them to FP8)
sed 's/_row_reduce(s, True, SCALED_P)/_row_reduce(s, True, True)/; s/_row_reduce(p, False, SCALED_P)/_row_reduce(p, False, True)/' \
    /tmp/new.py > /tmp/tree16.py
for v in base new base new; do
    if [ $v = base ]; then cp ab_base_fwd_sm90.py $F; else cp /tmp/new.py $F; fi
    echo "=== fp8 $v" >> $LOG
    timeout 100 python3 -m fusedattn bench --configs fp8 --pass fwd --quick --only s2048-d128,s8192-d128,s16384-d128 \
        2>&1 | grep -E '^\| [0-9]' >> $LOG
done
cp /tmp/new.py $F
echo "=== tests 3.6" >> $LOG
timeout 150 python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/test_gluon_fp8.py tests/test_fp8.py 2>&1 | tail -1 >> $LOG
echo "=== tests 3.9" >> $LOG
OUT=/tmp/o39 TRITON_PACK=3.9.0 DEADLINE=150 TEST_PATHS="tests/test_gluon_fp8.py" bash bench/run_device.sh tests >/dev/null 2>&1
grep -E 'passed|failed' /tmp/o39/run.log | tail -1 >> $LOG
for v in new tree16 new tree16; do
    if [ $v = new ]; then cp /tmp/new.py $F; else cp /tmp/tree16.py $F; fi
    echo "=== bf16 $v" >> $LOG
    timeout 60 python3 -m fusedattn bench --configs anchors --pass fwd --quick --only s8192-d128,s16384-d128 2>&1 \
        | grep -E '^\| [0-9]' >> $LOG
done
cp /tmp/new.py $F
