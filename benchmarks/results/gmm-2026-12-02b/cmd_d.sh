# lease 1 of 2026-12-02 (afternoon): the Pallas dw kernel checked and timed (launch sweep), then the
# k3-small step with tokamax's dw (default) and with the Pallas dw, same lease
source benchmarks/gpu_env.sh
T0=$SECONDS
timeout 200 python3 benchmarks/gmm_check.py --dw-pallas --pallas-only \
  --dw-sweep "64,128,128,4,3;32,128,128,4,4;128,128,128,8,2;64,64,128,4,3;64,128,64,4,3;64,64,64,4,4;128,64,128,8,3;64,128,256,8,2" \
  --json $OUT/gmm_check_pallas.json > $OUT/gmm_check_pallas.log 2>&1
echo "check rc $? at $((SECONDS-T0)) s" >> $OUT/summary.txt
STEP=(benchmarks/train_step.py --model k3-small --steps 13)
timeout 175 python3 "${STEP[@]}" --json $OUT/step_tokamax_dw.json mesh.num_devices=1 train.batch_size=8 > $OUT/step_tokamax_dw.log 2>&1
echo "step tokamax rc $? at $((SECONDS-T0)) s" >> $OUT/summary.txt
timeout 175 python3 "${STEP[@]}" --json $OUT/step_pallas_dw.json mesh.num_devices=1 train.batch_size=8 model.moe.gmm_weight_grad=pallas > $OUT/step_pallas_dw.log 2>&1
echo "step pallas rc $? at $((SECONDS-T0)) s" >> $OUT/summary.txt
grep -v "^WARNING" $OUT/gmm_check_pallas.log | grep -E "dw|mlp" | cut -c1-220 >> $OUT/summary.txt
for f in $OUT/step_*.log; do echo "== $f"; grep -v "^WARNING" $f | tail -4; done >> $OUT/summary.txt
