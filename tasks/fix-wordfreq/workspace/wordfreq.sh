#!/bin/sh
# wordfreq.sh FILE [K]: the K most frequent words of FILE
K=$2
cat $1 | tr ' ' '\n' | sort | uniq -c | sort -r | head -$K
