source benchmarks/gpu_env.sh
for bk in 64 128; do
  timeout 150 python3 .device/nan_check.py $bk --model k3-small --steps 11 --json $OUT/dw_bk$bk.json mesh.num_devices=1 train.batch_size=8 train.micro_batches=1 > $OUT/dw_bk$bk.log 2>&1
  echo "bk $bk rc $?" >> $OUT/summary.txt
  python3 -c "import json; d=json.load(open('$OUT/dw_bk$bk.json')); print($bk, d['step_ms'], d['losses'])" >> $OUT/summary.txt 2>&1
done
cat $OUT/summary.txt
