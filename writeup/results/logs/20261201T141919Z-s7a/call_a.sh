set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
export CS336_CALL_ID=$(date -u +%Y%m%dT%H%M%SZ)-s7a
bash tools/gpu.sh python3 scratch/bench_exp.py 2>&1 | tee $OUT/bench_exp.log
for d in 128 64; do
  bash tools/gpu.sh ncu --clock-control none --set full --import-source yes -k regex:_attn_bwd_kernel -c 2 -f -o $OUT/prof$d python3 scratch/ncu_target.py $d > $OUT/ncu$d.log 2>&1
  ncu -i $OUT/prof$d.ncu-rep --page details --csv > $OUT/details$d.csv 2>&1
  ncu -i $OUT/prof$d.ncu-rep --page source --csv --print-source sass > $OUT/source$d.csv 2>&1
done
cd $OUT && tar czf ncu.tgz details*.csv source*.csv ncu*.log && rm -f source*.csv && ls -la
