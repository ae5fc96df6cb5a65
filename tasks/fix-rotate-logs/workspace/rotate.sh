#!/bin/sh
# rotate.sh DIR KEEP: keep the KEEP newest app-YYYYMMDD.log files in DIR, delete the rest.
DIR=$1
KEEP=$2
cd $DIR
FILES=$(ls -t app-*.log)
COUNT=$(echo "$FILES" | wc -l)
DEL=$((COUNT - KEEP))
for f in $(echo "$FILES" | head -n $DEL); do
  rm $f
  echo $f
done
