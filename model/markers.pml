/*
 * celery-dlock's marker protocol (enqueue-time uniqueness: lock_mode, on_duplicate),
 * checked with spin.  The code: celery_dlock/task/modes.py (the send),
 * task/markers.py (the record a message carries), task/handover.py (start and end on
 * the worker), task/locked_task.py and task/rate.py (contention, parks, retries),
 * backends/redis/marker_scripts.py (CLAIM, CONFIRM, UNDO, HAND_OVER, CLEAR).  See
 * docs/protocol.md, "The marker protocol", for the prose and what is left out.
 *
 * NS sends of one lock name, each a process (its caller), each with a task id (two
 * sends may share one: -DSAME_ID), a countdown (0 or CD ticks), and maybe a member of
 * a group, chord or chain.  A send claims the marker (one atomic CLAIM), publishes its
 * message (one publish in a run may fail: a serializer's refusal, the broker down),
 * then confirms its replace (CONFIRM, then the revoke of the call it replaced) or
 * takes its claim back (UNDO).  A replace that finds another replace's publish not
 * settled asks again once it is (CLAIM answers PENDING), or, past its wait, is a
 * duplicate of it.  One claim's reply in a run may be lost (-DLOST_REPLY): redis-py
 * sends the claim again, with the same operation id.  No time passes from a send's claim to its end (a
 * publish takes milliseconds), but every other process may step in between.  Two
 * workers take messages whose eta has come, in any order: a revoked id is discarded
 * (revokes live in worker memory, which a worker restart loses: -DRESTART); the
 * runtime lock (an ideal mutex here: dlock.pml checks it) is taken, or the call is
 * re-queued (a contention retry) or gives up; with the lock held the rate may park it
 * (-DPARK: the lock released, the call re-queued); the hand-over (one atomic
 * HAND_OVER) removes the marker, confirms or takes back a pending replace, or finds
 * the call superseded (a call that goes on is kept among the started calls waiting
 * until its end); the body runs and may retry (self.retry), or its worker may die
 * (-DDEATH, until_started: the lock lapses and the message comes back, with nothing
 * written for it: a whole worker killed, or the store out of reach then).  Every re-queue is a
 * message that carries its own marker record (CLAIM with requeue) and is published
 * before the attempt releases its lock.  Time is a tick counter; markers and replaced
 * ids expire; a queued call starts before its marker expires (the assumption of every
 * mode but throttle: a call starts within lock_queue_ttl after its eta).
 *
 * Modes (-DMODE=...): UF until_finished, US until_started (queued_and_running is the
 * same protocol at the marker: the claim does not count a running holder), TH
 * throttle.  -DREPLACE: on_duplicate="replace" (else return_existing: raise and drop
 * differ from it only in what the caller is handed).
 *
 * Properties (assertions):
 *   P1 (UF) at most one call per name is queued or running: a body starts only when
 *      every other call whose body ran had ended before this call was accepted;
 *   P2 a replaced call never runs;
 *   P3 no accepted call is lost: at the end every send ran to its end, or its caller
 *      was told (a duplicate of another call, the publish error, its contention
 *      retries ran out), or
 *      it was superseded by a call that was published (so a failed replace replaces
 *      nothing);
 *   P4 a task id is never published twice while a call of it is queued or running
 *      (only the call's own re-queue publishes it again);
 *   P5 (TH) the window counts from the accepted enqueue: a send is a duplicate only
 *      within TTL of the last claim, and claims only after that;
 *   P6 a call that started is never superseded nor replaced (its retry runs);
 *   P7 (US) a call is never superseded by the call it replaced: when that one starts
 *      before the replace is confirmed, it takes the replace back and both run (a
 *      running call is no duplicate in until_started and queued_and_running).
 *
 * Mutants (each must produce a counterexample): the defects of issue 31, items 1-6,
 * and of the code on its way to the fix (the last four the model found in the code
 * after issue 31 was closed; docs/protocol.md):
 *   SAME_ID_OURS      the claim answers "ours" to a second send of the same task id (1)
 *   ALWAYS_OURS       the claim answers "ours" to every send (1)
 *   NO_CLAIM_OP       a re-sent claim (its reply lost) is not known for the first: the
 *                     send is told a duplicate of itself (1)
 *   NO_RETRY_STATE    until_started: nothing says a started call waits for its retry
 *                     (its re-queue claims nothing), so its task id sent again is
 *                     published a second time (1)
 *   SHORT_RECORD      a replaced id is kept only as long as the new marker (2)
 *   REQUEUE_REPLACED  a replaced call's re-queue (a contention retry, a park) takes the
 *                     marker or outlives the record of it (2)
 *   FAIL_REVOKES      a replace whose publish failed still revokes the queued call (3)
 *   CHAIN             a replace replaces a replace whose publish is not settled: when
 *                     its own publish fails, the earlier replace, published, never
 *                     runs (the model's CLAIM answers PENDING, and the send asks again
 *                     once the other has settled, or is a duplicate of it) (3)
 *   RETRY_SUPERSEDED  the retry of a started call claims, and is superseded when
 *                     another call holds the marker (4)
 *   WINDOW_RESTART    a throttle call's re-queue restarts its window (5)
 *   NO_FORWARD        a duplicate member of a group, chord or chain: its own id never
 *                     gets an outcome (6)
 *   REPLACE_STARTED   a replace may replace a started call's re-queued retry
 *   CONFIRM_BLIND     a confirm that finds no record revokes anyway (also a call that
 *                     took the replace back and runs)
 *   CLAIM_REPLACED    a claim of a task id in the replaced set may be claimed: a
 *                     re-sent claim whose replace was taken back meanwhile is claimed
 *                     anew and published, and a later failed replace's UNDO removes it
 *                     from the set, so it runs after the call that took it back (now:
 *                     such a claim is answered "queued")
 *   NO_PDL_RAISE      a call replaced by a pending replace and re-queued (a park)
 *                     keeps its old marker time for the UNDO to give back: the name
 *                     frees while the re-queued message waits (now: the re-queue
 *                     raises it)
 *   RESULT_STORE_CHECK until_started: "waits for its retry" read from the result store
 *                     before the claim, and set there after the attempt released its
 *                     lock: a send of the same task id in between is published (now:
 *                     the retry's re-queue leaves the id for the claim to read, in the
 *                     claim's own step, and the retry's start takes it out)
 *   OLD_TAKE_BACK     (US) a replaced call that starts before the replace is
 *                     confirmed takes it back and the replacing call never runs (as in
 *                     until_finished): the latest call is lost to an earlier one
 *   NO_KEEP           (US, -DDEATH) a started call's task id is not kept among the
 *                     waiting from its hand-over to its end: a worker that dies with
 *                     the store out of reach (nothing written for the redelivery)
 *                     leaves its message to come back as a call superseded by one
 *                     queued meanwhile (P6)
 *   NO_ADOPT          (US, -DDEATH) a started call's message come back and re-queued
 *                     (contention, a park) claims the marker as a call that never
 *                     started: a replace then replaces it (P6)
 *   OP_IN_RECORD      an undo that gives a marker back clears the claim record's
 *                     operation id instead of giving back the one that wrote that
 *                     marker: 1 claims, its reply is lost, 2 replaces 1 and its publish
 *                     fails (UNDO gives 1 its marker back): 1's claim, sent again, is
 *                     told a duplicate of itself, never published (now: the replace
 *                     keeps it, pop, and the undo gives it back)
 */

#define UF 1
#define US 2
#define TH 3
#ifndef MODE
#define MODE UF
#endif
#ifndef NS
#define NS 3              /* sends */
#endif
#ifndef QTTL
#define QTTL 2            /* lock_queue_ttl, in ticks */
#endif
#ifndef TTL
#define TTL 3             /* throttle's window (lock_ttl) */
#endif
#ifndef CD
#define CD 2              /* a countdown: a send's is 0 or CD */
#endif
#define RCD 1             /* a re-queue's countdown */
#ifndef SEND_BY
#define SEND_BY 4         /* sends happen at ticks 0 .. SEND_BY */
#endif
#ifndef REQUEUES
#define REQUEUES 2        /* re-queues in a run (parks, contention retries, retries) */
#endif
#define NM 4              /* message slots in the broker */
#define NW 2              /* workers */
#define FAR 255           /* no bound */

/* claim replies, as the script's */
#define CLAIMED 0
#define OURS 1
#define QUEUED 2
#define RUNNING 3
#define REPLACED 4
#define PENDING 5         /* a replace found another replace's publish not settled */

/* a send's outcome (ghost) */
#define NONE 0
#define RAN 1             /* its body ran to its end */
#define DUP 2             /* its caller was told: a duplicate */
#define ERR 3             /* its caller got the publish error */
#define SUP 4             /* superseded (revoked or found replaced at its start) */
#define GAVE_UP 5         /* its contention retries ran out: LockNotAcquired */

#define BIT(i) (1 << (i))
#define ID(k) id_of[k]

byte now = 0;
byte id_of[NS + 1];
byte cd_of[NS + 1];
bool member[NS + 1];     /* a member of a group, chord or chain */

/* -- the server ---------------------------------------------------------------- */
byte m_k = 0;            /* P:{N}:m: the send whose task id it holds (0: none) */
byte m_exp = 0;          /* its expiry */
bool m_st = false;       /* it is the retry of a started call (until_finished) */
byte r_until[NS + 1];    /* P:{N}:mr: per task id, replaced until then (0: not) */
byte rec_pend = 0;       /* P:{N}:mc: a replace whose publish is not confirmed yet, */
byte rec_pold = 0;       /*   the call it replaced (the first of a chain of them), */
byte rec_pdl = 0;        /*   that call's marker's expiry, */
byte rec_conf = 0;       /*   the last replace confirmed, */
byte rec_back = 0;       /*   the last replace taken back by the replaced call's start, */
byte rec_op = 0;         /*   and the send whose claim wrote it last (its op), */
byte rec_pop = 0;        /*   the op that wrote the marker a pending replace replaced */
byte l_k = 0;            /* the runtime lock's holder (a send), 0 free */
bool rs[NS + 1];         /* P:{N}:mw: it started and has not ended, or its retry
                          * waits holding no marker (until_started);
                          * RESULT_STORE_CHECK: the result store says RETRY */

/* -- the broker, and the workers' revoke memory -------------------------------- */
byte q_k[NM];            /* the send a message is a call of (0: empty slot) */
byte q_eta[NM];
byte q_dl[NM];           /* by then the call starts: its marker's expiry (FAR: none) */
bool q_st[NM];           /* the message is the retry of a started call */
byte w_rev = 0;          /* revoked task ids, in worker memory */
byte w_dl[NW];           /* a worker between taking a message and its hand-over */
bool w_busy[NW];
byte requeues = 0;
byte sent = 0;           /* sends that have finished */
byte publishing = 0;     /* sends between their claim and their end */
bool fail_budget = true; /* one publish may fail */
bool lost_budget = true; /* one claim's reply may be lost (-DLOST_REPLY) */

/* -- ghosts, for the properties only --------------------------------------------- */
byte out[NS + 1];
byte sup_by[NS + 1];     /* the send that superseded it */
byte repl_of[NS + 1];    /* the send its replace replaced (0: none) */
bool tb[NS + 1];         /* its replace was taken back, it stays queued (P:{N}:mb) */
byte dup_of[NS + 1];     /* the send it was told a duplicate of */
byte rep_by[NS + 1];     /* the send that replaced it (0: none, or taken back) */
bool pub[NS + 1];        /* accepted: its message was published */
bool replaced[NS + 1];   /* replaced for good: it must never run */
bool started[NS + 1];    /* its body started (at least once) */
byte acc_ev[NS + 1];
byte end_ev[NS + 1];
byte ev = 0;
byte win_t = FAR;        /* (TH) when the window of the last claimed call began */

#define MARKER_LIVE (m_k != 0 && now < m_exp)
#define HOLDS_ID(k) (l_k != 0 && ID(l_k) == ID(k))
#ifdef RETRY_SUPERSEDED
#define BARE(st) false    /* the old code: every re-queue claims, every start is checked */
#define CHECKED(st) true
#else
#define BARE(st) (st && MODE != UF)  /* a started call's retry claims nothing here */
#define CHECKED(st) (!st)            /* a started call's retry is never superseded */
#endif
#define IS_REPLACED(k) (r_until[ID(k)] > now)
#ifdef CLAIM_REPLACED
#define NOT_REPLACED(k) true
#else
#define NOT_REPLACED(k) (!IS_REPLACED(k))
#endif

/* a message into a free slot (there always is one: NS sends, REQUEUES re-queues,
 * a message leaves its slot when a worker takes it) */
inline put(k, eta, dl, st) {
  if
  :: q_k[0] == 0 -> q_k[0] = k; q_eta[0] = eta; q_dl[0] = dl; q_st[0] = st
  :: else -> if
     :: q_k[1] == 0 -> q_k[1] = k; q_eta[1] = eta; q_dl[1] = dl; q_st[1] = st
     :: else -> if
        :: q_k[2] == 0 -> q_k[2] = k; q_eta[2] = eta; q_dl[2] = dl; q_st[2] = st
        :: else -> assert(q_k[3] == 0);
                   q_k[3] = k; q_eta[3] = eta; q_dl[3] = dl; q_st[3] = st
        fi
     fi
  fi
}

inline expire() {
  if
  :: !MARKER_LIVE -> m_k = 0; m_st = false
  :: else -> skip
  fi
}

inline del_rec() {
  rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_conf = 0; rec_back = 0; rec_op = 0;
  rec_pop = 0
}

/* a claim that writes the record: no replace pending, none confirmed or taken back */
inline new_rec(k) { rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_conf = 0; rec_back = 0;
                    rec_op = k; rec_pop = 0 }

/* the replaced set keeps a task id until then at least */
inline remember(k, upto) {
  if
  :: r_until[ID(k)] < upto -> r_until[ID(k)] = upto
  :: else -> skip
  fi
}

/* CLEAR: remove the marker if it holds this task id */
inline clear(k) {
  expire();
  if
  :: m_k != 0 && ID(m_k) == ID(k) -> m_k = 0; m_st = false
  :: else -> skip
  fi;
#ifndef RESULT_STORE_CHECK
  rs[k] = false                              /* and it no longer waits for a retry */
#endif
}

/* P4: no other call of this task id is queued or running */
inline check_id_free(k) {
  i = 1;
  do
  :: i > NS -> break
  :: i <= NS ->
     assert(i == k || ID(i) != ID(k) || !pub[i] || out[i] != NONE);
     i++
  od
}

/* CLAIM of a caller's send (not a re-queue): code, and the other send (0: none) */
inline claim(k, code, other, ttl) {
  expire();
  other = 0;
#ifdef ALWAYS_OURS
  /* never a duplicate: "ours" over a marker, a claim without one */
  if
  :: m_k != 0 -> code = OURS; m_exp = now + ttl
  :: m_k == 0 -> code = CLAIMED; m_k = k; m_exp = now + ttl; m_st = false; new_rec(k)
  fi
#else
#if MODE == US && !defined(NO_RETRY_STATE) && !defined(RESULT_STORE_CHECK)
  /* a send of a task id whose started call waits for its retry (its re-queue claimed
   * nothing here, but left its id with the claim record) is that call */
  i = 1;
  do
  :: i > NS -> break
  /* (the running call itself: the holder's answer, below) */
  :: i <= NS && i != k && ID(i) == ID(k) && rs[i] && out[i] == NONE && !HOLDS_ID(k) ->
     code = QUEUED; other = i; goto claimed
  :: i <= NS && !(i != k && ID(i) == ID(k) && rs[i] && out[i] == NONE) -> i++
  od;
#endif
  if
#ifndef CLAIM_REPLACED
  :: IS_REPLACED(k) ->                       /* replaced (or taken back): never runs */
     code = QUEUED;
     if
     :: m_k != 0 -> other = m_k
     :: else -> other = rep_by[k]
     fi
  :: !IS_REPLACED(k) && m_k != 0 && ID(m_k) == ID(k) ->
#else
  :: m_k != 0 && ID(m_k) == ID(k) ->
#endif
#ifdef SAME_ID_OURS
     code = OURS; m_exp = now + ttl          /* "ours": the old script's answer */
#else
     code = QUEUED; other = m_k              /* a second send of a queued call */
#endif
  :: NOT_REPLACED(k) && m_k == 0 && l_k != 0 && (MODE == UF || ID(l_k) == ID(k)) ->
     code = RUNNING; other = l_k             /* running: its holder (or itself) */
  :: NOT_REPLACED(k) && m_k == 0 && (l_k == 0 || (MODE != UF && ID(l_k) != ID(k))) ->
     code = CLAIMED; m_k = k; m_exp = now + ttl; m_st = false; new_rec(k)
  :: NOT_REPLACED(k) && m_k != 0 && ID(m_k) != ID(k) ->
#ifdef REPLACE
     if
#ifndef REPLACE_STARTED
     :: m_st -> code = QUEUED; other = m_k   /* a started call's retry: not replaced */
#endif
#ifndef CHAIN
     :: rec_pend == m_k -> code = PENDING; other = m_k  /* a replace not settled yet */
#endif
     :: else ->
     /* pending until its publish is confirmed; the call it replaced is kept in the
      * replaced set as long as its message could be delivered (its marker's time,
      * and at least the new marker's) */
     code = REPLACED; other = m_k;
     if
     :: rec_pend == m_k ->                   /* a chain: it keeps the first (if any) */
        if
        :: rec_pold != 0 -> rep_by[rec_pold] = k
        :: else -> skip
        fi
     :: else -> rec_pold = m_k; rec_pdl = m_exp
     fi;
#ifdef SHORT_RECORD
     r_until[ID(m_k)] = now + ttl;
#else
     if
     :: m_exp > now + ttl -> remember(m_k, m_exp)
     :: else -> remember(m_k, now + ttl)
     fi;
#endif
     rep_by[m_k] = k;
     m_k = k; m_exp = now + ttl; m_st = false;
     rec_pop = rec_op;                       /* what an undo gives back with it */
     rec_pend = k; rec_conf = 0; rec_back = 0; rec_op = k
     fi
#else
     code = QUEUED; other = m_k
#endif
  fi
#endif
claimed:
  skip
}

/* A re-queue of send k (a rate park, a contention retry, a retry of a started call:
 * a message carrying its own marker record), then its publish (assumed to succeed).
 * In throttle, and for a started call's retry in until_started, it claims nothing. */
inline requeue(k, st) {
  atomic {
    requeues++;
    expire();
#if MODE == TH
#ifdef WINDOW_RESTART
    /* the old code: the re-queue's claim moves the window to a full ttl from now */
    if
    :: m_k != 0 && ID(m_k) == ID(k) -> m_exp = now + TTL
    :: m_k == 0 -> m_k = k; m_exp = now + TTL
    :: else -> skip
    fi;
#endif
    put(k, now + RCD, FAR, st)               /* claims nothing: the window counts on */
#else
    if
    :: BARE(st) ->
#ifndef RESULT_STORE_CHECK
       rs[k] = true;                         /* its task id waits for its retry */
#endif
       put(k, now + RCD, FAR, st)
    :: else ->
#ifndef REQUEUE_REPLACED
       /* a replaced call (or one whose replace is pending) is re-queued as it is,
        * and the record of it lasts as long as its new message could be delivered */
       if
       :: IS_REPLACED(k) && CHECKED(st) ->
          remember(k, now + RCD + QTTL);
#ifndef NO_PDL_RAISE
          if
          :: rec_pend != 0 && rec_pold == k && rec_pdl < now + RCD + QTTL ->
             rec_pdl = now + RCD + QTTL        /* an undo gives it a marker that long */
          :: else -> skip
          fi;
#endif
          put(k, now + RCD, now + RCD + QTTL, st);
          goto requeued
       :: else -> skip
       fi;
#endif
       if
       :: m_k != 0 && ID(m_k) == ID(k) ->
          /* OURS: delivered, so its publish went through: its replace is confirmed */
          if
          :: rec_pend == k -> replaced[rec_pold] = true;
                              rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_pop = 0
          :: else -> skip
          fi;
          m_exp = now + RCD + QTTL; m_st = m_st || st;
          put(k, now + RCD, m_exp, st)
       :: m_k != 0 && ID(m_k) != ID(k) -> put(k, now + RCD, FAR, st)  /* left alone */
       :: m_k == 0 -> m_k = k; m_exp = now + RCD + QTTL; m_st = st;
                      rec_op = 0;            /* the re-queue's own op */
                      put(k, now + RCD, m_exp, st)
       fi
    fi
#endif
  }
requeued:
  skip
}

/* P5, in the claim's own step: a new window only when the last one has passed; a
 * duplicate only within it */
inline window(code) {
#if MODE == TH
  if
  :: code == CLAIMED -> assert(win_t == FAR || now >= win_t + TTL); win_t = now
  :: code == QUEUED || code == RUNNING -> assert(win_t != FAR && now < win_t + TTL)
  :: else -> skip
  fi
#else
  skip
#endif
}

proctype Send(byte k) {
  byte code, other, i, ttl, owin;
  bool ok, stands, lost;
  /* its moment: any tick up to SEND_BY (the clock waits for it until then) */
#if MODE == TH
  ttl = TTL;
#else
  ttl = QTTL + cd_of[k];
#endif
#if MODE == US && defined(RESULT_STORE_CHECK)
  /* (the code as it stands) until_started: a task id the caller chose, whose started
   * call waits for its retry (the result store says RETRY, read before the claim), is
   * that call: a duplicate, nothing claimed */
  atomic {
    publishing++;
    i = 1;
    do
    :: i > NS -> break
    :: i <= NS && i != k && ID(i) == ID(k) && rs[i] && out[i] == NONE ->
       code = QUEUED; other = i; out[k] = DUP; dup_of[k] = i; break
    :: i <= NS && !(i != k && ID(i) == ID(k) && rs[i] && out[i] == NONE) -> i++
    od
  };
  if
  :: out[k] == DUP -> goto done
  :: else -> skip
  fi;
  atomic {
#else
  atomic {
    publishing++;                    /* no time passes from its claim to its end */
#endif
    owin = win_t;
    claim(k, code, other, ttl); window(code);
#ifdef LOST_REPLY
    if
    :: lost_budget -> lost_budget = false; lost = true   /* its reply is lost */
    :: true -> skip
    fi;
#endif
    skip
  };
#ifdef LOST_REPLY
  if
  :: lost ->
     /* redis-py sends the claim again (the same operation id): its first reply */
     atomic {
       expire();
#ifndef NO_CLAIM_OP
       if
       /* the marker holds its task id and the record its op (the claim that wrote
        * the marker: an undo that gave the marker back gave that op back too) */
       :: m_k != 0 && ID(m_k) == ID(k) && rec_op == k ->
          if
          :: rec_pend == k -> code = REPLACED; other = rec_pold
          :: else -> code = CLAIMED; other = 0
          fi
       :: else -> claim(k, code, other, ttl); window(code)
       fi
#else
       claim(k, code, other, ttl); window(code)
#endif
     }
  :: else -> skip
  fi;
#endif
  /* another replace's publish not settled: ask again once it is (it settles in
   * milliseconds), or, past the wait, a duplicate of that call */
  do
  :: code != PENDING -> break
  :: atomic { code == PENDING && rec_pend != other -> claim(k, code, other, ttl); window(code) }
  :: atomic { code == PENDING -> code = QUEUED }
  od;
  atomic {
    if
    :: code == QUEUED || code == RUNNING ->
       dup_of[k] = other;
#ifdef NO_FORWARD
       if
       :: member[k] -> skip                  /* its own id is never given an outcome */
       :: else -> out[k] = DUP
       fi
#else
       out[k] = DUP                          /* (a member: a follower takes its outcome) */
#endif
    :: else -> skip
    fi
  };
  if
  :: code == QUEUED || code == RUNNING -> goto done
  :: else -> skip
  fi;
  /* publish */
  atomic {
    if
    :: fail_budget -> fail_budget = false; ok = false
    :: true -> ok = true
    fi;
    if
    :: ok ->
       check_id_free(k);                     /* P4 */
#if MODE == TH
       put(k, now + cd_of[k], FAR, false);
#else
       put(k, now + cd_of[k], now + ttl, false);
#endif
       pub[k] = true; ev++; acc_ev[k] = ev
    :: else -> out[k] = ERR
    fi
  };
  atomic {
    if
    :: ok && code == REPLACED ->
       repl_of[k] = other;
       /* CONFIRM: the replace stands unless the call it replaced started first */
       if
       :: tb[k] -> stands = false; tb[k] = false  /* taken back: it stays queued */
       :: !tb[k] && rec_conf == k -> stands = true  /* a re-send, or it started first */
       :: !tb[k] && rec_conf != k && rec_back == k -> stands = false   /* taken back */
       :: !tb[k] && rec_conf != k && rec_back != k && rec_pend != k ->
#ifdef CONFIRM_BLIND
          stands = true                      /* nothing known of it: revoke anyway */
#else
          stands = !IS_REPLACED(k)           /* unless it is replaced itself */
#endif
       :: !tb[k] && rec_conf != k && rec_back != k && rec_pend == k ->
          replaced[rec_pold] = true;
          rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_pop = 0; rec_conf = k;
          stands = true
       fi;
       if
       :: stands -> replaced[other] = true; assert(!started[other]);
                    w_rev = w_rev | BIT(ID(other))              /* revoke */
       :: else -> skip
       fi
    :: !ok && (code == CLAIMED || code == REPLACED) ->
#ifdef FAIL_REVOKES
       if
       :: code == REPLACED -> w_rev = w_rev | BIT(ID(other))  /* revoked all the same */
       :: else -> skip
       fi;
#endif
       /* UNDO: a replace gives the name back to the call it replaced; a claim goes */
       expire();
       if
       :: rec_op == k ->
          i = 0;                             /* (here: the op the record keeps) */
          if
          :: rec_pend == k && rec_pold != 0 ->
             r_until[ID(rec_pold)] = 0; rep_by[rec_pold] = 0;
             if
             :: m_k == k && rec_pdl > now -> m_k = rec_pold; m_exp = rec_pdl; m_st = false;
#ifndef OP_IN_RECORD
                i = rec_pop                  /* and the op that wrote that marker */
#endif
             :: m_k == k && rec_pdl <= now -> m_k = 0
             :: else -> skip
             fi
          :: else ->
             if
             :: m_k == k -> m_k = 0
             :: else -> skip
             fi
          fi;
          rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_op = i; rec_pop = 0; i = 0
       :: rec_op != k && rec_pold == k -> rec_pold = 0; rec_pdl = 0
       :: else -> skip
       fi;
       win_t = owin                          /* (TH: no window opened) */
    :: else -> skip
    fi
  };
done:
  atomic { publishing--; sent++ }
}

/* A message taken: its call runs, or ends without running. */
inline work(w, k, st) {
  /* revoked: the worker discards it (task_revoked frees its marker) */
  if
  :: atomic { (w_rev & BIT(ID(k))) != 0 ->
       w_dl[w] = FAR;
#if MODE != TH
       clear(k);
#endif
       assert(!started[k]);                  /* P6 */
       out[k] = SUP; sup_by[k] = rep_by[k]; ev++; end_ev[k] = ev };
     goto next
  :: else -> skip
  fi;
#if !defined(NO_KEEP) && !defined(NO_ADOPT) && !defined(RESULT_STORE_CHECK)
  /* found among the started calls waiting: a started call's message (come back after
   * its worker died): CLAIM and HAND_OVER take it for the started call's from here */
  if
  :: rs[k] -> st = true
  :: else -> skip
  fi;
#endif
  /* the runtime lock, or contention */
  atomic {
    if
    :: l_k == 0 -> l_k = k; got = true
    :: l_k != 0 && ID(l_k) != ID(k) -> got = false;
       if
       :: requeues < REQUEUES -> requeue(k, st)     /* a contention retry */
       :: else ->
#if MODE != TH
          clear(k);                          /* free_marker: it ends without running */
#endif
          out[k] = GAVE_UP; ev++; end_ev[k] = ev
       fi;
       w_dl[w] = FAR
    fi
    /* held by an earlier attempt of this very call (a retry published before its
     * release): it waits for it (_same_task_holder) */
  };
  if
  :: !got -> goto next
  :: else -> skip
  fi;
#ifdef PARK
  /* over the rate (asked with the lock held): released, then parked */
  if
  :: atomic { requeues < REQUEUES -> l_k = 0; requeue(k, st); w_dl[w] = FAR }; goto next
  :: true -> skip
  fi;
#endif
#if MODE != TH
  /* HAND_OVER (a started call's retry in until_started claimed nothing: no hand-over;
   * in until_finished it is never superseded) */
  atomic {
    w_dl[w] = FAR;
    sup = 0;
    if
    :: BARE(st) ->
#ifndef RESULT_STORE_CHECK
       rs[k] = false;                        /* it started: the lock holds its id */
#endif
       goto handed
    :: else -> skip
    fi;
    expire();
#ifndef RESULT_STORE_CHECK
    /* found among the waiting: a started call's message come back (its worker
     * process died): it started before any call that took the marker since, and is
     * never superseded */
    if
    :: rs[k] -> rs[k] = false; st = true
    :: else -> skip
    fi;
#endif
    if
    :: rec_pend == k -> replaced[rec_pold] = true;      /* it started first: confirmed */
                        rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_pop = 0;
                        rec_conf = k
#if MODE == US && !defined(OLD_TAKE_BACK)
    :: rec_pend != 0 && rec_pend != k && rec_pold == k && CHECKED(st) ->
       /* replaced by a call whose publish is not confirmed: it takes the replace back
        * and runs; the replacing call stays queued under the marker and runs after
        * it (a running call is no duplicate here), as one sent just after it
        * started would */
       r_until[ID(k)] = 0; rep_by[k] = 0; tb[rec_pend] = true;
       rec_back = rec_pend; rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_pop = 0;
       goto handed
#else
    :: rec_pend != 0 && rec_pend != k && rec_pold == k && CHECKED(st) ->
       /* replaced by a call whose publish is not confirmed: it takes the replace back
        * and runs; the replacing call never does (a running call is a duplicate) */
       r_until[ID(k)] = 0; rep_by[k] = 0;
       if
       :: m_exp > now + 1 -> remember(rec_pend, m_exp)
       :: else -> remember(rec_pend, now + 1)
       fi;
       rep_by[rec_pend] = k; replaced[rec_pend] = true;
       if
       :: m_k == rec_pend -> m_k = 0; m_st = false
       :: else -> skip
       fi;
       rec_back = rec_pend; rec_pend = 0; rec_pold = 0; rec_pdl = 0; rec_op = 0;
       rec_pop = 0;
       goto handed
#endif
    :: else -> skip
    fi;
    if
    :: CHECKED(st) && IS_REPLACED(k) -> sup = rep_by[k]
    :: else ->
       if
       :: m_k != 0 && ID(m_k) == ID(k) -> m_k = 0; m_st = false; del_rec()
       :: m_k != 0 && ID(m_k) != ID(k) && CHECKED(st) -> sup = m_k
       :: m_k != 0 && ID(m_k) != ID(k) && !CHECKED(st) -> skip
       :: m_k == 0 -> skip
       fi
    fi;
    if
    :: sup != 0 -> assert(!started[k]);   /* P6 */
                   l_k = 0; out[k] = SUP; sup_by[k] = sup; ev++; end_ev[k] = ev
    :: else -> skip
    fi;
handed:
#if !defined(NO_KEEP) && !defined(RESULT_STORE_CHECK)
    /* a call that goes on is kept among the started calls waiting until its end */
    if
    :: sup == 0 -> rs[k] = true
    :: else -> skip
    fi
#else
    skip
#endif
  };
  if
  :: sup != 0 -> goto next
  :: else -> skip
  fi;
#else
  w_dl[w] = FAR;
#endif
  /* the body starts */
  atomic {
    assert(!replaced[k]);                    /* P2 */
#if MODE == UF
    i = 1;                                   /* P1 */
    do
    :: i > NS -> break
    :: i <= NS ->
       assert(i == k || !started[i] || (out[i] != NONE && end_ev[i] < acc_ev[k]));
       i++
    od;
#endif
    started[k] = true
  };
  if
#ifdef RESULT_STORE_CHECK
  :: atomic { requeues < REQUEUES -> requeue(k, true); l_k = 0 };  /* self.retry */
     rs[k] = true                 /* then the result store says RETRY (after the release) */
#else
  /* self.retry: re-queued (its task id known to be waiting for its retry), released */
  :: atomic { requeues < REQUEUES -> requeue(k, true); l_k = 0 }
#endif
#ifdef DEATH
  /* its worker dies (whole, or with the store out of reach: nothing is written): the
   * lock lapses, and its message comes back as it was sent (acks_late) */
  :: atomic { requeues < REQUEUES -> requeues++; l_k = 0; put(k, now, FAR, false) }
#endif
  :: atomic { true -> l_k = 0; ev++; end_ev[k] = ev; out[k] = RAN };
#ifndef RESULT_STORE_CHECK
     rs[k] = false                           /* then CLEAR: it leaves the waiting */
#else
     skip
#endif
  fi;
next:
  skip
}

proctype Worker(byte w) {
  byte k, i, sup;
  bool st, got;
end_worker:
  do
  :: atomic {
       if
       :: q_k[0] != 0 && q_eta[0] <= now -> k = q_k[0]; st = q_st[0]; w_dl[w] = q_dl[0];
                                             q_k[0] = 0
       :: q_k[1] != 0 && q_eta[1] <= now -> k = q_k[1]; st = q_st[1]; w_dl[w] = q_dl[1];
                                             q_k[1] = 0
       :: q_k[2] != 0 && q_eta[2] <= now -> k = q_k[2]; st = q_st[2]; w_dl[w] = q_dl[2];
                                             q_k[2] = 0
       :: q_k[3] != 0 && q_eta[3] <= now -> k = q_k[3]; st = q_st[3]; w_dl[w] = q_dl[3];
                                             q_k[3] = 0
       fi;
       w_busy[w] = true
     };
     work(w, k, st);
     atomic { w_busy[w] = false; w_dl[w] = FAR; k = 0; st = false; sup = 0; got = false }
  od
}

#ifdef RESTART
/* A worker restart, once, at any moment: the revokes it kept in memory are lost. */
proctype Restart() {
  if
  :: w_rev = 0
  :: skip
  fi
}
#endif

/* Time passes while something waits for it; never past the moment a queued call must
 * start by (its marker's expiry: the assumption that a call starts within
 * lock_queue_ttl after its eta). */
#define QUIET (sent == NS && q_k[0] == 0 && q_k[1] == 0 && q_k[2] == 0 \
               && q_k[3] == 0 && !w_busy[0] && !w_busy[1])
#define DUE(i) (q_k[i] != 0 && now + 1 >= q_dl[i])
#define WAITING(i) (q_k[i] != 0 && q_eta[i] > now)
proctype Clock() {
  do
  :: atomic { (publishing == 0 && !DUE(0) && !DUE(1) && !DUE(2) && !DUE(3)
               && now + 1 < w_dl[0] && now + 1 < w_dl[1]
               && (WAITING(0) || WAITING(1) || WAITING(2) || WAITING(3)
                   || (sent < NS && now < SEND_BY))) -> now++ }
  :: atomic { QUIET -> break }
  od
}

init {
  byte k;
  atomic {
    w_dl[0] = FAR; w_dl[1] = FAR;
    k = 1;
    do
    :: k > NS -> break
    :: k <= NS ->
       id_of[k] = k;
#ifdef SAME_ID
       if
       :: k == 2 -> id_of[k] = 1             /* the same task id, sent again */
       :: true -> skip
       fi;
#endif
       if
       :: cd_of[k] = 0
       :: cd_of[k] = CD
       fi;
       if
       :: k == 2 -> member[k] = true
       :: true -> skip
       fi;
       k++
    od;
    run Clock();
    run Worker(0); run Worker(1);
#ifdef RESTART
    run Restart();
#endif
    k = 1;
    do
    :: k > NS -> break
    :: k <= NS -> run Send(k); k++
    od
  };
  /* the end: every process but this one has ended (the workers wait in their end
   * state), nothing is queued */
  QUIET;
  k = 1;
  do
  :: k > NS -> break
  :: k <= NS ->
     /* P3: no accepted call is lost; superseded only by a call that was published */
     assert(out[k] != NONE);
     assert(out[k] != SUP || (sup_by[k] != 0 && pub[sup_by[k]]));
     assert(out[k] != DUP || dup_of[k] != k);   /* never a duplicate of itself */
#if MODE == US
     /* P7 (US): never superseded by the call it replaced (that one started first:
      * both run, as when it started before this send) */
     assert(out[k] != SUP || repl_of[k] == 0 || sup_by[k] != repl_of[k]);
#endif
     k++
  od
}
